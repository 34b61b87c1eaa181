"""Sequential looks: which look of the suite's plan a candidate's run is, the alpha it spends, and what a look
decides (pass, fail, or continue to the next look)."""

from __future__ import annotations

import math
from typing import cast

from quantkit.errors import CannotCompare
from quantkit.evaluation.run_dir import RunRecord
from quantkit.release.behaviour import BehaviourCheck
from quantkit.release.stats import look_alphas
from quantkit.release.suite import Suite
from quantkit.release.verdict import Decision, SequentialLook, TaskVerdict


def look(spec: Suite, base: RunRecord, cand: RunRecord, alpha_one_sided: float, candidate) -> SequentialLook:
    """Which look of the suite's plan the candidate's run is, and the alpha that look spends: every task's items are
    the seeded-order prefix at one and the same look (eval --order seeded --fraction t). Looks that round to one item
    count for a task are one look there, the last of them, spending what they spend together: a run of every item is
    always the last look, which decides."""
    plan = spec.sequential
    assert plan is not None  # called for sequential suites only
    sizes: dict[str, list[int]] = {}
    for task in spec.tasks:
        b, c = base.tasks.get(task), cand.tasks.get(task)
        if b is None or c is None or c.population is None or c.items is None:
            raise CannotCompare(f"task {task}: a sequential gate needs both runs to hold it with its item count",
                                candidate)
        if c.order != "seeded":
            raise CannotCompare(f"task {task}: the candidate's items are in the file's order; a sequential gate looks "
                                "at seeded-order prefixes (eval --order seeded --fraction)", candidate)
        sizes[task] = [math.ceil(t * c.population) for t in plan.looks]
        if c.items not in sizes[task]:
            raise CannotCompare(f"task {task}: {c.items} items is none of the looks {sizes[task]} of the suite's plan",
                                candidate)
    counts = {task: cast(int, cand.tasks[task].items) for task in spec.tasks}
    index = max((i for i in range(len(plan.looks)) if all(sizes[t][i] == counts[t] for t in spec.tasks)), default=None)
    if index is None:
        raise CannotCompare("the tasks were evaluated at different looks; evaluate them at one --fraction", candidate)
    alphas = look_alphas(alpha_one_sided, plan.looks, plan.spending)
    # a task spends from the first look past the last one at which it held fewer items; min: none over-spends
    alpha = min(sum(alphas[next(i for i in range(index + 1) if sizes[t][i] == counts[t]):index + 1])
                for t in spec.tasks)
    items = sum(counts.values())
    population = sum(cast(int, cand.tasks[t].population) for t in spec.tasks)
    return SequentialLook(look=index + 1, looks=len(plan.looks), fraction=plan.looks[index], items=items,
                          population=population, alpha=alpha)


def decision(verdict: TaskVerdict, look: SequentialLook | None) -> Decision:
    """Pass when the interval's low end clears -margin; at a look before the last, fail only when its high end is
    below -margin (inferiority shown), else continue to the next look."""
    if verdict.passed:
        return "pass"
    if look is None or look.look == look.looks or verdict.high < -verdict.margin:
        return "fail"
    return "continue"


def overall(verdicts: list[TaskVerdict], behaviour: list[BehaviourCheck], look: SequentialLook | None) -> str:
    if any(v.decision == "fail" for v in verdicts):
        return "fail"
    if any(v.decision == "continue" for v in verdicts):
        return "continue"
    if not all(check.passed for check in behaviour):
        return "continue" if look is not None and look.look < look.looks else "fail"
    return "pass"
