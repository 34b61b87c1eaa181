"""A long-context task from local text: find one of several access codes hidden in a long document.

Short tasks can sit at parity while a quantized model loses points at 32K (published INT4/FP4 builds
did). ``needle_<N>k`` builds N x 1024 tokens (counted with the model's own tokenizer) of filler from
quantkit's bundled GSM8K train problems, hides ``KEYS`` sentences "The access code of <name> is
<5 digits>." at random depths, and asks for one of them. Everything is drawn from a fixed seed, so the
same tokenizer always gets the same items (and the task's data hash says so). A model that copies any
code from the context without finding the right one scores 1/KEYS: that is the chance level.
"""

from __future__ import annotations

import json
import random
import re

from quantkit.errors import QuantkitError

NEEDLE_TASK = re.compile(r"^needle_([1-9]\d{0,3})k$")  # a bounded parse: never thousands of digits
MAX_K = 1024  # needle_1024k: a million tokens, more than any model quantkit converts reads at once
KEYS = 4
ITEMS = 50
SEED = 0
ANSWER_TOKENS = 16
NAMES = ("Alder", "Birch", "Cedar", "Dahlia", "Elm", "Fern", "Ginkgo", "Hazel", "Iris", "Juniper", "Kale", "Laurel",
         "Maple", "Nettle", "Olive", "Poppy", "Quince", "Rowan", "Sage", "Thyme", "Umber", "Violet", "Willow", "Yarrow")


def is_needle_task(task: str) -> bool:
    m = NEEDLE_TASK.match(task)
    return m is not None and int(m.group(1)) <= MAX_K


def context_tokens(task: str) -> int:
    m = NEEDLE_TASK.match(task)
    if m is None:
        raise QuantkitError(f"{task} is not a needle_<N>k task")
    return int(m.group(1)) * 1024


def needle_spec() -> dict:
    """The lm-eval task fields of every needle_<N>k task (its data file comes from ``needle_items``)."""
    return {
        "output_type": "generate_until",
        "doc_to_text": "{{context}}\n\nQuestion: What is the access code of {{name}}?\nAnswer: The access code of "
                       "{{name}} is",
        "doc_to_target": "{{code}}",
        "metric": "exact_match",
        "until": ["\n"],
        "max_gen_toks": ANSWER_TOKENS,
        "extract": r"(\d{5})",
    }


def needed_context(task: str) -> int:
    """Tokens a model's context must hold for the task: the document, the question and the answer."""
    return context_tokens(task) + 64 + ANSWER_TOKENS


def needle_items(task: str, tokenizer) -> list[dict]:
    """The task's items: each a long context holding KEYS codes, the name asked for and its code."""
    total = context_tokens(task)
    rng = random.Random(f"{SEED}-{task}")
    filler = _filler_sentences()
    costs = [len(ids) for ids in tokenizer([" " + s for s in filler], add_special_tokens=False)["input_ids"]]
    items = []
    for _ in range(ITEMS):
        names = rng.sample(NAMES, KEYS)
        codes = [f"{rng.randrange(10_000, 100_000)}" for _ in names]
        needles = [f"The access code of {n} is {c}." for n, c in zip(names, codes, strict=False)]
        budget = total - sum(len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in needles) - 48
        text: list[str] = []
        used = 0
        start = rng.randrange(len(filler))
        while used < budget:
            at = (start + len(text)) % len(filler)
            if used + costs[at] > budget:
                break
            text.append(filler[at])
            used += costs[at]
        for needle in needles:
            text.insert(rng.randrange(len(text) + 1), needle)
        asked = rng.randrange(KEYS)
        items.append({"context": " ".join(text), "name": names[asked], "code": codes[asked]})
    return items


def needle_jsonl(task: str, tokenizer) -> bytes:
    return "".join(json.dumps(item) + "\n" for item in needle_items(task, tokenizer)).encode()


def _filler_sentences() -> list[str]:
    from quantkit.calibration_data import DEFAULT_DATA

    sentences = []
    for line in DEFAULT_DATA.read_text().splitlines():
        question = json.loads(line)["text"].split("\n")[0]
        sentences += [s.strip() + "." for s in question.split(".") if len(s.strip()) > 20 and not re.search(r"\d{5}",
                                                                                                            s)]
    return sentences
