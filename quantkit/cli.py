"""The quantkit command line's face: the Typer app, its global options and the one error path, over one module per
command group (quantkit/commands/), each of which only parses, calls one quantkit function and prints.

Heavy libraries (torch, transformers, compressed-tensors) are imported inside the commands,
so ``quantkit --help`` answers at once. Errors are turned into one line in one place
(``_one_line``), as huggingface_hub's ``hf`` does: a QuantkitError is the user's to fix (exit 1),
a run that cannot be compared exits 2, file-system and network failures name the path or the
host, and anything else is a bug in quantkit, reported in one line (the traceback with --debug).
"""

from __future__ import annotations

import functools
import os
import traceback
from typing import Annotated

import typer

from quantkit.commands import checkpoint, conversion, evaluation, planning, release
from quantkit.commands.common import err, out, shown

app = typer.Typer(
    help="Offline quantization and checkpoint conversion for giant Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_debug = {"on": os.environ.get("QUANTKIT_DEBUG", "") not in ("", "0")}


def _print_version(value: bool) -> None:
    if value:
        from quantkit import __version__

        out.print(f"quantkit {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an unexpected error.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print quantkit's version and exit.")] = False,
) -> None:
    """Offline quantization and checkpoint conversion for giant Mixture-of-Experts LLMs."""
    if debug:
        _debug["on"] = True
    _quiet_libraries()


def command(name: str):
    """Register a command whose every failure ends as one line and an exit code (``_one_line``)."""

    def register(fn):
        @functools.wraps(fn)
        def handled(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - the one place every failure is reported
                kind, message, code = _one_line(exc)
                if _debug["on"] and kind == "internal error":
                    traceback.print_exc()
                err.print(f"[bold red]{kind}:[/] {shown(message)}", markup=True, highlight=False, soft_wrap=True)
                raise typer.Exit(code) from None

        return app.command(name)(handled)

    return register


def _one_line(exc: BaseException) -> tuple[str, str, int]:
    """(kind, the message on one line, exit code) for any failure of a command."""
    from quantkit.errors import CannotCompare, QuantkitError, describe_os_error

    def flat(text: object) -> str:
        return " ".join(str(text).split())

    if isinstance(exc, CannotCompare):
        return "cannot compare", flat(exc), 2
    if isinstance(exc, QuantkitError):
        return "error", flat(exc), 1
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "stopped; files under their final names are complete, re-run to resume", 130
    if isinstance(exc, OSError) and not type(exc).__module__.startswith(("requests", "urllib3")):
        return "error", flat(describe_os_error(exc)), 1
    module = type(exc).__module__.split(".")[0]
    if module in ("httpx", "requests", "urllib3", "huggingface_hub", "httpcore"):
        return "error", f"network or hub failure ({type(exc).__name__}): {flat(exc)[:400]}", 1
    hint = "" if _debug["on"] else " (re-run with --debug for the traceback)"
    return ("internal error", f"{type(exc).__name__}: {flat(exc)[:400]}; this is a bug in quantkit, please report "
            f"it{hint}", 1)


def _quiet_libraries() -> None:
    """lm-eval and transformers warn about things quantkit does on purpose (a pre-loaded model,
    the tokenizer's clean-up flag); the user's terminal is for progress and results. Off a
    terminal, libraries' own progress bars would fill a log with carriage returns."""
    import logging

    for name in ("lm_eval", "lm-eval", "transformers", "datasets", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # transformers and datasets set their loggers' level from these when first imported (after this runs)
    for variable in ("TRANSFORMERS_VERBOSITY", "HF_DATASETS_VERBOSITY", "HF_HUB_VERBOSITY"):
        os.environ.setdefault(variable, "error")
    if not err.is_terminal:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


# In the order `--help` lists them: a checkpoint's life from first look to release.
COMMANDS = [("inspect", checkpoint.inspect_cmd), ("convert", conversion.convert_cmd),
            ("calibrate-kv", conversion.calibrate_kv_cmd), ("verify", conversion.verify_cmd),
            ("plan", planning.plan_cmd), ("budget", planning.budget_cmd), ("eval", evaluation.eval_cmd),
            ("gate", evaluation.gate_cmd), ("publish", release.publish_cmd), ("release", release.release_cmd),
            ("demo", release.demo_cmd), ("synth", checkpoint.synth_cmd)]
for _name, _fn in COMMANDS:
    command(_name)(_fn)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
