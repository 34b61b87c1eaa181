"""Importing llm-compressor inside quantkit without its log in quantkit's output, and without breaking it.

llm-compressor configures its loguru logger once, at import: it binds the ``sys.stdout`` of that moment and logs
there, so it is imported with stdout pointing at stderr (its lines never mix into ``--json``). Its log is switched
off by its own ``LLM_COMPRESSOR_LOG_DISABLED`` (a user's own setting stands): it warns at import that no accelerator
is present, and what it did to each weight quantkit reports itself.

With its log disabled, llm-compressor 0.14's ``configure_logger`` returns before it registers its ``METRIC`` level,
while its ``CompressionLogger`` (utils/metric_logging.py) still logs at that level after every GPTQ or AutoRound
module, and loguru looks a level up before it looks at whether the caller is disabled: llm-compressor's own
``oneshot`` in the same process then fails with "Level 'METRIC' does not exist". The level is registered here as
``configure_logger`` would (number 38), so importing through quantkit leaves llm-compressor usable.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from quantkit.errors import QuantkitError


@contextlib.contextmanager
def quiet_llmcompressor(needs: str) -> Iterator[None]:
    """Import llm-compressor (and what goes with it) inside this block; a missing install is refused with
    ``needs`` ("GPTQ recipes need llm-compressor"), the import error and the install command."""
    with contextlib.redirect_stdout(sys.stderr):
        chosen = "LLM_COMPRESSOR_LOG_DISABLED" in os.environ
        os.environ.setdefault("LLM_COMPRESSOR_LOG_DISABLED", "true")  # read once, by its import
        try:
            yield
        except ImportError as exc:
            raise QuantkitError(f"{needs} ({exc}); pip install 'quantkit[gptq]'") from exc
        finally:
            if not chosen:
                os.environ.pop("LLM_COMPRESSOR_LOG_DISABLED", None)
    _register_metric_level()


def _register_metric_level() -> None:
    from loguru import logger

    try:
        logger.level("METRIC")
    except ValueError:
        logger.level("METRIC", no=38)
