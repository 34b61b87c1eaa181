"""What a generated answer looked like, beyond whether it was right: its length, whether it ran into the
length limit, and whether it looped.

Accuracy cannot see an INT4 build whose answers grew by half or that loops on a few prompts; these
per-item figures, kept in RUN_DIR beside correctness, let the gate compare them item by item.
"""

from __future__ import annotations

from dataclasses import dataclass

# A loop: one stretch of tokens repeated back to back at least this many times ...
LOOP_REPEATS = 3
# ... covering at least this share of the answer.
LOOP_SHARE = 0.5
# Periods searched for a repeat, in tokens: from a stuck token to a repeated sentence or two.
MAX_PERIOD = 64
# Re-tokenizing decoded text can come out a few tokens off the generated ids, so an answer within this
# many tokens of the limit is counted as having hit it.
LIMIT_SLACK = 4


@dataclass(frozen=True)
class GenerationStats:
    tokens: int
    hit_limit: bool
    repetition: float  # share of the tokens covered by the longest back-to-back repeat (>= LOOP_REPEATS copies)

    @property
    def looped(self) -> bool:
        return looped(self.repetition)


def generation_stats(token_ids: list[int], max_tokens: int) -> GenerationStats:
    return GenerationStats(len(token_ids), len(token_ids) >= max_tokens - LIMIT_SLACK, repeated_share(token_ids))


def repeated_share(ids: list[int]) -> float:
    """The largest share of ``ids`` covered by one segment repeated back to back at least LOOP_REPEATS times
    (0 when there is none): "the the the the" -> 1.0, a normal answer -> 0."""
    n = len(ids)
    best = 0
    for period in range(1, min(MAX_PERIOD, n // LOOP_REPEATS) + 1):
        run = 0  # positions i with ids[i] == ids[i + period], consecutively
        for i in range(n - period):
            run = run + 1 if ids[i] == ids[i + period] else 0
            span = run + period  # tokens covered by the repeat ending here
            if span >= LOOP_REPEATS * period and span > best:
                best = span
    return best / n if n else 0.0


def looped(repetition: float | None) -> bool:
    return repetition is not None and repetition >= LOOP_SHARE


def runaway(hit_limit: bool | None, repetition: float | None) -> bool:
    """A runaway generation: it hit the length limit or looped."""
    return bool(hit_limit) or looped(repetition)
