"""Building the hundreds of thousands of small objects that describe a 700 GB checkpoint without the cyclic
garbage collector rescanning them as they pile up.

Reading a GLM-5-sized checkpoint's headers or planning its conversion keeps some 120,000 tensor records and
180,000 output records alive, none of them in a reference cycle. CPython's collector runs whenever allocations
outnumber frees by 700 and, as the survivors grow, rescans all of them again and again: a third of ``plan``'s time
went there. Nothing these functions build needs the collector; it is switched off while they run and back on after
(where it was on), and what it would have found is collected by its next run.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(function: Callable[P, R]) -> Callable[P, R]:
    """Run ``function`` with the cyclic collector off; nested and repeated uses leave it as they found it."""

    @functools.wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        was_on = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()

    return paused
