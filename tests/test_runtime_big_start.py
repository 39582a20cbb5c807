"""Big models start: programs of a tiny LLaMA and GPT-2 built on ``device="meta"`` train on 2 and 4
gloo ranks like one process, each rank making only its own pieces (autopar.runtime.weights).

Per model and world size the plans are data parallel, FSDP, Megatron tensor parallel (tp = the
world, planned under a memory limit that makes it split weights) and a pipeline (2 stages, 2
micro-batches; GPT-2's embedding is tied to its head in the last stage). Every program trains 3
SGD steps from

- the model's initialisers: equal to one process that calls ``to_empty()`` and the model's own
  initialisers (transformers' ``init_weights``) after ``torch.manual_seed(0)``
  (:func:`one_process.initialised`), which is the reference of every run here;
- that reference saved with ``save_pretrained``: one ``model.safetensors`` (2 ranks), and shards of
  a few KiB with their index (4 ranks);
- an autopar checkpoint (DCP) saved by an FSDP program on 4 ranks and loaded on 2.

Losses and final parameters must equal the one-process fp32 run (:mod:`one_process`, SGD: rtol
1e-5, atol 1e-6). Then gradient clipping (``clip_grad_norm_`` at half the first step's gradient
norm) with two accumulated passes per step equals one process doing the same, under FSDP, tensor
parallel and GPT-2's pipeline (a parameter two stages hold); and ``step()`` returns a detached
0-dim tensor in both program kinds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.core.options import Options
from autopar.core.placement import Shard, parse_placement
from autopar.runtime import checkpoint
from autopar.testing import run_on_ranks, run_programs
from one_process import initialised, one_process
from tight import tightest

pytestmark = pytest.mark.slow  # rank processes

pytest.importorskip("transformers")

SIZES = {"llama": dict(layers=2, hidden=16, heads=4, kv_heads=2, ffn=32, batch=4),
         "gpt2": dict(layers=2, hidden=16, heads=4, batch=4)}
SEED, STEPS, LR = 0, 3, 0.1
PLANS = ("dp", "fsdp", "tp", "pp")


@dataclasses.dataclass
class Case:
    meta: torch.nn.Module
    example: dict  # meta example inputs (planning)
    inputs: dict  # the real batch
    ref: torch.nn.Module  # to_empty + the model's initialisers under SEED


@pytest.fixture(scope="module")
def cases():
    out = {}
    for name, sizes in SIZES.items():
        meta, (args, kwargs) = getattr(zoo, name)(device="meta", **sizes)
        ids = torch.randint(0, 128, tuple(args[0].shape), generator=torch.Generator().manual_seed(1))
        out[name] = Case(meta, {"input_ids": args[0], "labels": kwargs["labels"].clone()},
                         {"input_ids": ids, "labels": ids.clone()}, initialised(meta, SEED))
    return out


@pytest.fixture(scope="module")
def folders(cases, tmp_path_factory):
    """``(model, kind) -> path``: the references saved with save_pretrained (one file, or shards
    of 8 KiB with their index)."""
    out = {}
    for name, case in cases.items():
        for kind, size in (("single", "5GB"), ("sharded", "8KB")):
            path = tmp_path_factory.mktemp(f"{name}-{kind}")
            case.ref.save_pretrained(path, max_shard_size=size)
            assert (path / "model.safetensors.index.json").exists() == (kind == "sharded")
            out[(name, kind)] = path
    return out


def _plans(case, world):
    local = Cluster.local(world_size=world)
    kw = dict(example_inputs=case.example)
    plans = {"dp": baselines.data_parallel(case.meta, local, **kw), "fsdp": baselines.fsdp(case.meta, local, **kw)}
    plans["tp"] = tightest(lambda c, o: baselines.megatron(case.meta, c, tp=world, options=o, **kw), local)
    plans["pp"] = baselines.megatron(case.meta, local, tp=1, pp=2, micro_batches=2,
                                     options=Options(pipeline=True), **kw)
    sharded = {k: {f for f, pl in p.parameter_placements.items() if any(isinstance(parse_placement(x), Shard)
                                                                        for x in pl)} for k, p in plans.items()}
    assert not sharded["dp"] and sharded["fsdp"] and sharded["tp"] and len(plans["pp"].stages) == 2
    return {k: compile(case.meta, local.with_mesh(p.mesh_shape), plan=p, **kw) for k, p in plans.items()}


@pytest.fixture(scope="module")
def compiled(cases, memo_capture):
    """``world -> {(model, plan): compiled}`` (planned once per world size; each model captured
    once for all its plans, conftest's ``memo_capture``)."""
    memo = {}

    def get(world):
        if world not in memo:
            memo[world] = {(name, k): c for name, case in cases.items() for k, c in _plans(case, world).items()}
        return memo[world]

    return get


def _check(results, cases, **run):
    refs = {name: one_process(case.ref, inputs=case.inputs, steps=STEPS, optimizer="sgd", lr=LR, **run)
            for name, case in cases.items()}
    bad = []
    for label, (losses, params) in results.items():
        ref = refs[label.split()[0]]
        assert ref.losses[-1] < ref.losses[0], label
        bad += [f"{label}: {line}" for line in ref.mismatches(losses, params)]
    assert not bad, "\n".join(bad)


def _runs(cases, compiled, sources):
    """``{"<model> <plan> <source>": (program, inputs, None, checkpoint)}``."""
    return {f"{name} {plan} {source}": (c, cases[name].inputs, None, path)
            for (name, plan), c in compiled.items() for source, path in sources(name).items()}


def test_emitted_programs_of_meta_models_hold_no_meta_device(cases, compiled):
    for (name, plan), c in compiled(2).items():
        for rank in range(2):
            assert "meta" not in c.code(rank), f"{name} {plan} rank {rank}"


def test_four_ranks_start_from_initialisers_and_sharded_folders_like_one_process(cases, compiled, folders):
    runs = _runs(cases, compiled(4), lambda name: {"init": None, "sharded": folders[(name, "sharded")]})
    _check(run_programs(runs, steps=STEPS, lr=LR, return_parameters=True, seed=SEED, timeout=900), cases)


def _save_fsdp(programs, root):
    for name, program in programs.items():
        program.start()
        checkpoint.save(program, f"{root}/{name}")


def test_two_ranks_start_from_initialisers_a_single_file_and_a_four_rank_checkpoint(cases, compiled, folders,
                                                                                     tmp_path):
    four = Cluster.local(world_size=4)
    fsdp4 = {name: compile(case.ref, four, example_inputs=case.inputs,
                           plan=baselines.fsdp(case.ref, four, example_inputs=case.inputs)).program
             for name, case in cases.items()}
    run_on_ranks(_save_fsdp, world_size=4, args=(fsdp4, str(tmp_path)))
    runs = _runs(cases, compiled(2), lambda name: {"init": None, "single": folders[(name, "single")],
                                                   "dcp": tmp_path / name})
    _check(run_programs(runs, steps=STEPS, lr=LR, return_parameters=True, seed=SEED, timeout=900), cases)


def test_clipping_and_accumulation_equal_one_process_across_shards_and_stages(cases, compiled):
    run = dict(accumulate=2, max_norm=_half_first_norm(cases))
    chosen = [("llama", "fsdp"), ("llama", "tp"), ("gpt2", "pp"), ("gpt2", "tp")]
    runs = {f"{name} {plan}": (compiled(4)[(name, plan)], cases[name].inputs, None) for name, plan in chosen}
    _check(run_programs(runs, steps=STEPS, lr=LR, return_parameters=True, seed=SEED, timeout=900, **run),
           {name: cases[name] for name, _ in chosen}, **run)


def _half_first_norm(cases) -> float:
    """Half the smallest first-step gradient norm of the models (so every run is clipped)."""
    norms = []
    for case in cases.values():
        model = initialised(case.meta, SEED)
        model(**case.inputs).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), norm_type=2.0)))
    return min(norms) / 2


def _losses(programs, inputs):
    out = {}
    for name, program in programs.items():
        torch.manual_seed(SEED)  # the initialisers draw from this rank's RNG, as in one process
        loss = program.start().step(inputs)
        out[name] = (type(loss), loss.dim(), loss.requires_grad, float(loss))
    return out


def test_step_returns_a_detached_zero_dim_tensor(cases, compiled):
    programs = {plan: compiled(2)[("llama", plan)].program for plan in ("fsdp", "pp")}
    got = run_on_ranks(_losses, world_size=2, args=(programs, cases["llama"].inputs))[0]
    with torch.no_grad():
        want = float(cases["llama"].ref(**cases["llama"].inputs).loss)
    for plan, (kind, dim, requires_grad, value) in got.items():
        assert (kind, dim, requires_grad) == (torch.Tensor, 0, False), plan
        assert value == pytest.approx(want, rel=1e-5), plan
