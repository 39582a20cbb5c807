"""Every kind of plan the planner emits trains like one process, in every combination of what it
decides: the plan kind (autopar's own, data parallel, FSDP, tensor parallel, a 2-stage pipeline)
x ZeRO 0/1/2/3 x recompute (none, full, selective) x precision (fp32, bf16 with fp32 masters), each trained 3 steps with SGD and with
AdamW, gradients clipped to half the first step's norm, on 2 and on 4 gloo ranks.

GPT-2 (2 layers, its own loss) is judged by :mod:`one_process`: fp32 SGD against the fp32 run,
fp32 AdamW inside the float64 band, bf16 against the bf16 one-process run inside that policy's
band. The full product (``AUTOPAR_FULL_MATRIX=1``) is 108 runs; the suite runs a covering
subset in which every pair of values of any two factors (world size included) appears in some
run, picked greedily from the full product (:func:`covering`).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.core.options import Options
from autopar.testing import run_programs
from one_process import adamw, one_process

pytestmark = pytest.mark.slow  # rank processes

pytest.importorskip("transformers")

LR, STEPS = 0.01, 3
PRECISIONS = {"fp32": False, "bf16": "bf16"}


@dataclass(frozen=True)
class Run:
    """One cell of the matrix."""

    world: int
    kind: str  # "autopar", "dp", "fsdp", "tp", "pp"
    zero: int | None  # None: the planner's choice (autopar's own plan)
    recompute: bool | str  # False, True or "selective"
    precision: str  # key of PRECISIONS

    @property
    def name(self) -> str:
        zero = "auto" if self.zero is None else self.zero
        return f"{self.kind} zero{zero} recompute={self.recompute} {self.precision} on {self.world}"


def full_matrix() -> list[Run]:
    """Every combination the planner can emit for GPT-2 on 2 and 4 ranks."""
    zeros = {"autopar": (None,), "dp": (0, 1, 2), "fsdp": (3,), "tp": (0, 1, 3), "pp": (0, 1, 3)}
    runs = []
    for world, kind, recompute, precision in itertools.product((2, 4), zeros, (False, True, "selective"), PRECISIONS):
        for zero in zeros[kind]:
            if kind in ("tp", "pp") and world == 2 and zero:
                continue  # no data-parallel axis to shard over
            runs.append(Run(world, kind, zero, recompute, precision))
    return runs


def _pairs(run: Run) -> set:
    values = [(f, getattr(run, f)) for f in ("world", "kind", "zero", "recompute", "precision")]
    return set(itertools.combinations(values, 2))


def covering(runs: list[Run]) -> list[Run]:
    """A subset of ``runs`` holding every pair of factor values that ``runs`` holds, picked
    greedily (the run adding the most pairs not yet held, first in order on ties)."""
    missing = set().union(*map(_pairs, runs))
    chosen = []
    while missing:
        best = max(runs, key=lambda r: len(_pairs(r) & missing))
        chosen.append(best)
        missing -= _pairs(best)
    return chosen


def _selected(world: int) -> list[Run]:
    runs = full_matrix() if os.environ.get("AUTOPAR_FULL_MATRIX") else covering(full_matrix())
    return [r for r in runs if r.world == world]


def _plan(model, cluster, inputs, run: Run):
    options = Options(mixed_precision=PRECISIONS[run.precision], recompute=run.recompute,
                      pipeline=run.kind == "pp")
    kw = dict(example_inputs=inputs, options=options)
    if run.kind == "autopar":
        return None
    if run.kind == "dp":
        return baselines.data_parallel(model, cluster, zero=run.zero, **kw)
    if run.kind == "fsdp":
        return baselines.fsdp(model, cluster, **kw)
    if run.kind == "tp":
        if run.recompute is True or run.zero == 1:  # a one-stage pipeline: megatron's own knobs
            return baselines.megatron(model, cluster, tp=2, zero=run.zero, recompute=run.recompute,
                                      example_inputs=inputs, options=Options(mixed_precision=options.mixed_precision))
        return baselines.megatron(model, cluster, tp=2, zero=run.zero, **kw)
    return baselines.megatron(model, cluster, tp=1, pp=2, micro_batches=2, zero=run.zero, recompute=run.recompute,
                              **kw)


def _compiled(model, inputs, run: Run):
    cluster = Cluster.local(world_size=run.world)
    plan = _plan(model, cluster, inputs, run)
    if plan is None:
        options = Options(mixed_precision=PRECISIONS[run.precision], recompute=run.recompute)
        return compile(model, cluster, example_inputs=inputs, options=options)
    _check_decisions(plan, run)
    return compile(model, cluster.with_mesh(plan.mesh_shape), plan=plan, example_inputs=inputs)


def _check_decisions(plan, run: Run) -> None:
    """The plan holds the decisions the run names (so the run trains what it says)."""
    stages = plan.stages or ()
    recompute = {s.recompute for s in stages} if stages else {plan.recompute}
    assert recompute == {run.recompute}, (run.name, recompute)
    zero = {s.zero for s in stages} if stages else {plan.zero if run.kind != "fsdp" else 3}
    if run.kind in ("dp",) or stages:
        assert zero == {run.zero}, (run.name, zero)
    assert plan.precision == ("fp32" if run.precision == "fp32" else "mixed"), (run.name, plan.precision)


@pytest.fixture(scope="module")
def gpt2():
    model, (args, kwargs) = zoo.gpt2(layers=2, hidden=32, heads=4, batch=8, seq=8)
    inputs = {"input_ids": args[0], "labels": kwargs["labels"].clone()}
    model.zero_grad()
    model(**inputs).loss.backward()
    max_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))) / 2
    model.zero_grad()
    return model, inputs, max_norm


@pytest.fixture(scope="module")
def references(gpt2):
    """The one-process reference per (precision, optimizer), made once for both world sizes."""
    model, inputs, max_norm = gpt2
    made = {}

    def reference(precision: str, optimizer: str):
        if (precision, optimizer) not in made:
            policy = "fp32" if precision == "fp32" else "mixed"
            made[precision, optimizer] = ref = one_process(model, inputs=inputs, steps=STEPS, optimizer=optimizer,
                                                           lr=LR, precision=policy, max_norm=max_norm)
            assert ref.losses[-1] < ref.losses[0], (precision, optimizer)
        return made[precision, optimizer]

    return reference


def test_the_covering_subset_holds_every_pair_of_the_full_matrix():
    full = full_matrix()
    subset = covering(full)
    assert set().union(*map(_pairs, subset)) == set().union(*map(_pairs, full))
    assert len(subset) < len(full) / 2, (len(subset), len(full))


@pytest.mark.parametrize("world", [2, 4])
def test_every_decision_trains_like_one_process(gpt2, references, world, memo_capture):
    model, inputs, max_norm = gpt2
    runs = _selected(world)
    programs = {run.name: _compiled(model, inputs, run) for run in runs}
    results = run_programs(programs, inputs=inputs, optimizer=["sgd", adamw], lr=LR, steps=STEPS,
                           return_parameters=True, max_norm=max_norm, timeout=1200)
    bad = []
    for precision in {run.precision for run in runs}:
        for i, optimizer in enumerate(("sgd", "adamw")):
            ref = references(precision, optimizer)
            for run in runs:
                if run.precision == precision:
                    losses, params = results[run.name][i]
                    bad += [f"{run.name} {optimizer}: {line}" for line in ref.mismatches(losses, params)]
    assert not bad, "\n".join(bad)
