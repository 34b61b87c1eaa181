"""The gate's verdict (verdict.json): the schema that the gate writes and publish and the model card read."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from quantkit.release.behaviour import BehaviourCheck, NoiseFloor
from quantkit.settings import Section

Decision = Literal["pass", "fail", "continue"]  # continue: undecided at a sequential look before the last


class Signal(Section):
    name: str
    estimate: float
    low: float | None = None  # None: a point estimate without an interval
    high: float | None = None
    unit: str


class TaskVerdict(Section):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # verdict.json is strict JSON

    task: str
    n: int
    baseline: float  # accuracy, percent
    candidate: float
    delta: float  # points
    low: float
    high: float
    margin: float
    passed: bool
    flip_rate: float  # share of items whose correctness changed
    certifiable_margin: float  # points this n can certify at the observed discordance (true delta 0)
    items_for_margin: int  # items needed to certify the margin at that discordance
    signals: list[Signal] = Field(default_factory=list)
    decided_by: list[str] = Field(default_factory=list)
    # with an A/A run: whether the candidate's flip rate is within the engine's own (noise floor)
    engine_noise: Literal["indistinguishable from engine noise", "beyond engine noise"] | None = None
    regression: bool | None = None  # a failing task whose flips exceed the noise floor
    design_effect: float = 1.0  # clustered items: the interval is widened by its square root
    clusters: int | None = None
    decision: Decision = "fail"  # continue: undecided at a sequential look before the last
    note: str | None = None  # why this n cannot certify the margin, when it cannot


class SequentialLook(Section):
    look: int  # 1-based
    looks: int
    fraction: float  # share of the items the candidate was evaluated on
    items: int  # candidate items evaluated, over every task
    population: int  # items the tasks hold
    alpha: float  # one-sided alpha this look tests at, per task


class GateReport(Section):
    """The verdict (verdict.json): what publish and the model card trust."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    baseline: str
    candidate: str
    passed: bool
    confidence: float  # per task, after the correction
    correction: str
    tasks: list[TaskVerdict]
    candidate_checksums: dict[str, str]  # every file the candidate ships with -> sha256
    allowed_differences: list[str] = Field(default_factory=list)  # by the suite's may_differ
    behaviour: list[BehaviourCheck] = Field(default_factory=list)  # generative tasks: length, runaways
    noise_run: str | None = None  # the A/A run of the baseline's model
    gated: str | None = None  # with no suite named: which tasks were gated, and why those
    noise: list[NoiseFloor] = Field(default_factory=list)
    report_files: list[str] = Field(default_factory=list)
    decision: Decision = "fail"
    sequential: SequentialLook | None = None
    # what publish gates again with: the suite file (None: the tasks both runs hold, under the built-in suite's
    # rules) and the margin that overrode every task's
    suite: str | None = None
    margin: float | None = None
