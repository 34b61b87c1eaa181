"""Helpers the test files share (imported by name, unlike conftest's fixtures): the one place a test module takes
anything from, never another test module (tests/test_structure.py holds that)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers.links import OUTSIDE, plant_link, replaced_by_a_picture  # noqa: F401  (re-exported)
from helpers.recipes import INT4_GROUP, int4_group_recipe, release_config, signround_recipe  # noqa: F401
from helpers.runs import (  # noqa: F401
    BILLION_LAUGHS, evaluate_small, passing_verdict, suite, write_generations, write_run, write_seeded,
)
from quantkit.calibration_data import DEFAULT_DATA
from quantkit.evaluation.run_dir import SampleRecord
from quantkit.evaluation.tasks import TASKS
from quantkit.packaged import evaldata_dir


def quantkit(*args):
    """The CLI run in-process, as a user types it: every argument a string."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(result, *fragments, code: int | None = 1) -> str:
    """The output is one line holding every fragment, and the exit code is ``code`` (None: any but 0): the one
    assertion of quantkit's one-line errors."""
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    ok = result.exit_code not in (0, None) if code is None else result.exit_code == code
    assert ok and len(lines) == 1, result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


SHARED_EVALDATA = Path(__file__).resolve().parents[2] / "shared" / "evaldata"


def evaldata(*tasks: str) -> Path:
    """A folder of benchmark data in the hub's schema holding TASKS: the test sets quantkit ships (ARC-Easy, GSM8K),
    else ../shared/evaldata. Without either, the test module is skipped, naming what is missing."""
    for folder in (evaldata_dir(), SHARED_EVALDATA):
        if all((folder / TASKS[t]["file"]).is_file() for t in tasks):
            return folder
    pytest.skip(f"no test data for {', '.join(tasks)}: not shipped in quantkit/data/evaldata, no {SHARED_EVALDATA}",
                allow_module_level=True)


def add_word_tokenizer(model: Path, vocab: int = 512, bpe: bool = False) -> Path:
    """Give a synthetic checkpoint a real tokenizer: a word-level one (``bpe``: byte-level BPE, configured to ask
    for clean-up of spaces as some real ones are) trained on quantkit's bundled calibration text, at most
    ``vocab`` ids (the synthetic models' vocabulary), with an end-of-text token. Built offline in a second, so
    tests that need text (eval, calibrate-kv from text) can run on any synthetic model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [json.loads(line)["text"] for line in DEFAULT_DATA.read_text().splitlines()[:300]]
    special = ["<unk>", "<eos>"]
    if bpe:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
        trainer = trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=special)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>",
        "pad_token": "<eos>", "model_max_length": 256, "clean_up_tokenization_spaces": bpe}) + "\n")
    return model


def gptq_recipe(folder: Path, base: str = "glm5-int4-experts-gptq-g32", samples: int = 4, seq_len: int = 64,
                vocab: int = 512, seed: int = 0) -> Path:
    """A built-in GPTQ recipe calibrated on ``samples`` random token sequences of ``seq_len`` (fast on any device)."""
    from quantkit.packaged import recipes_dir

    data = folder / f"calibration-{seed}.jsonl"
    gen = torch.Generator().manual_seed(seed)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, vocab, (seq_len,), generator=gen).tolist()}) + "\n"
                            for _ in range(samples)))
    head, _, rest = (recipes_dir() / f"{base}.yaml").read_text().partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):]
    path = folder / f"{base}-small.yaml"
    path.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: {samples}\n  seq_len: {seq_len}\n{body}")
    return path


def first_layers(model: Path, out: Path, layers: int) -> Path:
    """A copy of a real Llama-architecture checkpoint keeping its first LAYERS decoder layers (weights as they are,
    embeddings, final norm and tokenizer kept): an equality test against a peer tool runs the same algorithm on the
    same weights and tokens per layer, in a fraction of the time of all of them."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    keep = {}
    for shard in sorted(model.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                keep[name] = tensor
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# BF16 on both sides, different kernels. The hf engine's log-likelihoods are BF16 numbers themselves (-23.75, -34.0,
# -32.5: their spacing is 0.125 from 16 to 32 and 0.25 from 32 to 64), a server's are float32 sums: vLLM's first run
# here differed by up to 0.29 nats at -29. Allowed: ``rel`` of the value (2 % by default) plus 0.1 nats.
def close(x: float, y: float, rel: float = 0.02) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y)) + 0.1


def samples(run_dir: Path, task: str) -> dict[str, SampleRecord]:
    lines = (run_dir / "samples" / f"{task}.jsonl").read_text().splitlines()
    return {r.item_id: r for r in map(SampleRecord.model_validate_json, lines)}


def compare_runs(hf_dir: Path, served_dir: Path, limits: dict[str, int], rel: float = 0.02) -> None:
    """The served engine's run scores every item as the in-process hf engine's run does: log-likelihoods ``close``
    (within ``rel``), the same verdict where the best choice is no near tie, and greedy generations scored the same."""
    for task, n in limits.items():
        hf, vl = samples(hf_dir, task), samples(served_dir, task)
        assert set(hf) == set(vl) and len(hf) == n
        for item in hf:
            a, b = hf[item], vl[item]
            if a.choice_logprobs is not None:
                pairs = zip(a.choice_logprobs, b.choice_logprobs or [], strict=True)
                assert all(close(x, y, rel) for x, y in pairs), (task, item, a.choice_logprobs, b.choice_logprobs)
                best, second = sorted(a.choice_logprobs, reverse=True)[:2]
                if not close(best, second, rel):  # a near tie in BF16 may go either way (seen: arc_easy-10)
                    assert a.correct == b.correct, (task, item, a.choice_logprobs, b.choice_logprobs)
            else:  # greedy generation: scored the same; the words may part where BF16 kernels round a near tie
                # differently (seen: gsm8k-1, " 2 * 2 * 1 = 2" against " 2 * 2 = 4"), down to an answer that stops at
                # once (seen on SGLang: gsm8k-2, "" against " 150"; the hf engine gave "" on gsm8k-15)
                assert b.generation is not None and a.correct == b.correct, (task, item, a.generation, b.generation)
        assert any(r.generation or r.choice_logprobs for r in vl.values()), f"{task}: the server answered nothing"


def held_out_batches(model: Path, samples: int = 64, seq_len: int = 256) -> list:
    """GSM8K *test* questions with their answers (no calibration set holds them), packed into ``samples`` sequences
    of ``seq_len`` tokens of the model's tokenizer, 8 to a batch."""
    from quantkit.calibration_data import model_tokenizer, token_batches

    path = evaldata_dir() / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    texts = [f"{r['question']}\n{r['answer']}" for r in rows]
    return token_batches(model_tokenizer(model), texts, samples, seq_len, 8, path, require_all=True)


def loaded(folder: Path, device: str):
    """A checkpoint as transformers loads it, computing in fp32: compressed-tensors decompresses INT4 weights into
    dense ones (left compressed, a Linear has no ``weight`` outside its model's own forward). Placed by
    ``device_map``: on an H200 (transformers 5.17) ``.to("cuda")`` left a decompressed model's weights on the CPU,
    and its logits met CUDA targets."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quantized = "quantization_config" in json.loads((folder / "config.json").read_text())
    extra = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if quantized else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map=device, **extra).eval()


def perplexity(folder: Path, batches: list, device: str) -> float:
    model, total, count = loaded(folder, device), 0.0, 0
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                             reduction="sum"))
            count += batch[:, 1:].numel()
    return math.exp(total / count)


def mlp_output_errors(source: Path, candidate: Path, batches: list, device: str) -> list[float]:
    """Per decoder layer, the relative error of the candidate's MLP output against the source's, each fed the
    source's own inputs to that MLP: what the quantized weights do to the output they make, layer by layer."""
    src, cand = loaded(source, device), loaded(candidate, device)
    pairs: list[list] = [[] for _ in src.model.layers]
    hooks = [layer.mlp.register_forward_hook(lambda _m, args, out, i=i: pairs[i].append((args[0], out)))
             for i, layer in enumerate(src.model.layers)]
    errors = []
    with torch.no_grad():
        for batch in batches:
            src(input_ids=batch.to(device), use_cache=False)
        for hook in hooks:
            hook.remove()
        for layer, seen in zip(cand.model.layers, pairs, strict=True):
            num = sum(float((layer.mlp(x) - want).square().sum()) for x, want in seen)
            den = sum(float(want.square().sum()) for _, want in seen)
            errors.append((num / den) ** 0.5)
    return errors


def stop_after_first_layer(src: Path, dst: Path, recipe) -> object:
    """A calibrated conversion stopped as its first layer is reported (an exception from the ``on_layer`` callback,
    as an interrupted run); that layer's report."""
    from quantkit.convert import convert

    class Stopped(Exception):
        pass

    seen = []

    def stop(report, layers):
        seen.append(report)
        raise Stopped

    with pytest.raises(Stopped):
        convert(src, dst, recipe, device="cpu", on_layer=stop)
    return seen[0]


def revise_in_place(src: Path, tensors: str = "") -> list[str]:
    """A new revision of ``src`` written over the old one where it lies: every BF16 and F32 tensor whose name holds
    ``tensors`` has each value's lowest mantissa bit flipped (finite stays finite), and the names, sizes and headers
    stay as they were. Returns the tensors changed."""
    import struct

    changed = []
    for shard in sorted(src.glob("*.safetensors")):
        with open(shard, "r+b") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            for name, info in header.items():
                if name == "__metadata__" or tensors not in name or info["dtype"] not in ("BF16", "F32"):
                    continue
                start, end = (8 + length + offset for offset in info["data_offsets"])
                step = 2 if info["dtype"] == "BF16" else 4
                f.seek(start)
                data = bytearray(f.read(end - start))
                data[::step] = bytes(b ^ 1 for b in data[::step])  # little-endian: the low byte's lowest bit
                f.seek(start)
                f.write(data)
                changed.append(name)
    return changed
