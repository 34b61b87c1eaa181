"""After boot: is the engine serving the checkpoint it was given, quantized as it is stored?

An engine can load a quantized checkpoint unquantized without a word (SGLang did for mixed checkpoints until its PR
#32736, 2026-07-29); its scores then belong to another model. So before the tasks, a run of a quantkit conversion
asks the engine for the log-likelihood of a few fixed texts and compares them with quantkit's own decoding of the
checkpoint (its strict loader, on the CPU) and of the source it was converted from. The probe passes when the
engine's answers are nearer the converted weights' than the source's; it fails when they are nearer the source's; it
is not checked when the two decodings are too close to tell apart (a near-lossless format), when the checkpoint has no
quantkit manifest or its source is gone, or when the model is too large to decode on this machine. run.json records
it, and the gate refuses a candidate whose probe failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

# (context, continuation) pairs: everyday text whose continuation a small model already predicts in part, so a
# change of weights moves each log-likelihood by a measurable amount
TEXTS = (
    ("The capital of France is", " Paris, and the capital of Italy is Rome."),
    ("One, two, three, four,", " five, six, seven, eight, nine, ten."),
    ("Water boils at a temperature of", " one hundred degrees Celsius at sea level."),
    ("The sun rises in the east and", " sets in the west every day of the year."),
)
MIN_SEPARATION = 0.05  # nats per text: below it the converted and source decodings cannot be told apart


class ProbeRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: Literal["pass", "fail", "not checked"]
    reason: str
    served: list[float] | None = None  # the engine's log-likelihood of each continuation
    converted: list[float] | None = None  # quantkit's decoding of the checkpoint served
    source: list[float] | None = None  # quantkit's decoding of the checkpoint it was converted from


def requests():
    from lm_eval.api.instance import Instance

    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(TEXTS)]


def probe(lm, model: Path) -> ProbeRecord:
    """Ask ``lm`` (lm-eval's model of the served engine) and compare, as the module says."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.errors import QuantkitError

    manifest = load_manifest(model)
    if manifest is None:
        return ProbeRecord(status="not checked", reason="no quantkit manifest: not a conversion to tell apart from "
                                                        "its source")
    source = Path(manifest.source_path)
    try:
        if open_checkpoint(source).fingerprint() != manifest.source_fingerprint:
            return ProbeRecord(status="not checked", reason=f"the source {source} is not the one the manifest names")
    except QuantkitError:
        return ProbeRecord(status="not checked", reason=f"the source {source} cannot be read")
    from quantkit.checkpoint.inspection import inspect_checkpoint
    from quantkit.verify.smoke import SMOKE_MAX_PARAMS  # what quantkit decodes whole on a CPU

    if inspect_checkpoint(model).total_params > SMOKE_MAX_PARAMS:
        return ProbeRecord(status="not checked", reason=f"over {SMOKE_MAX_PARAMS:,} parameters: not decoded on this "
                                                        "machine")
    served = [float(ll) for ll, _ in lm.loglikelihood(requests())]
    return judge(served, decode(model), decode(source))


def judge(served: list[float], converted: list[float], source: list[float]) -> ProbeRecord:
    def distance(a, b):
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)

    separation = distance(converted, source)
    figures = dict(served=served, converted=converted, source=source)
    if separation < MIN_SEPARATION:
        return ProbeRecord(status="not checked", reason=f"the converted and source weights answer alike "
                                                        f"({separation:.3f} nats a text apart)", **figures)
    to_converted, to_source = distance(served, converted), distance(served, source)
    status: Literal["pass", "fail"] = "pass" if to_converted < to_source else "fail"
    return ProbeRecord(status=status, reason=f"the engine's answers are {to_converted:.3f} nats a text from the "
                                             f"converted weights' and {to_source:.3f} from the source's "
                                             f"({separation:.3f} apart)", **figures)


def decode(model: Path) -> list[float]:
    """Each continuation's log-likelihood under quantkit's own decoding of ``model`` (CPU, in the model's dtype: what
    the engines compute in)."""
    import torch
    from transformers import AutoTokenizer

    from quantkit.modeling import load_model

    tokenizer = AutoTokenizer.from_pretrained(model)
    net = load_model(model).eval()
    out = []
    with torch.no_grad():
        for context, continuation in TEXTS:
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
            logits = net(input_ids=torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits[start - 1:-1], dim=-1)
            out.append(float(logprobs.gather(1, torch.tensor(whole[start:])[:, None]).sum()))
    return out
