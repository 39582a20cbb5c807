"""Every way a user can go wrong gets an autopar error saying what is wrong and what to do.

One test per case: the exception type and the key words of its message (what went wrong, and
the remedy). The cases that must *not* fail (an op without a rule, a batch the ranks do not
divide, BatchNorm buffers with tied weights) run on two gloo ranks in one spawn and must equal
the model trained in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import autopar
from autopar import Cluster, baselines, zoo
from autopar.baselines import BaselineError
from autopar.compile import compile
from autopar.core.errors import (
    AutoparError,
    CaptureError,
    ClusterError,
    InfeasibleError,
    InputError,
    PlanError,
    SolverTimeLimitWarning,
    UnsupportedDtypeError,
    UnsupportedOpWarning,
)
from autopar.core.options import Options, OptionsError
from autopar.plan import SCHEMA_VERSION, Plan
from autopar.testing import run_on_ranks, run_reference
from models import TiedBatchNorm, mlp

LOCAL2 = Cluster.local(world_size=2)


def _kw(batch=4, width=8):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    return dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)


@pytest.fixture(scope="module")
def mlp_plan():
    torch.manual_seed(0)
    model = mlp()
    return model, compile(model, LOCAL2, **_kw())


def test_every_error_is_an_autopar_error():
    for cls in (CaptureError, ClusterError, InfeasibleError, PlanError, UnsupportedDtypeError,
                InputError, OptionsError, BaselineError, autopar.CheckpointError):
        assert issubclass(cls, AutoparError), cls
    assert issubclass(UnsupportedDtypeError, CaptureError)


# ----------------------------------------------------------------------------- capture


class BranchOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


class SelectByMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0].sum()  # a shape that depends on values


def test_data_dependent_control_flow_is_a_capture_error_naming_the_line_and_torch_cond():
    with pytest.raises(CaptureError) as err:
        compile(BranchOnValues(), LOCAL2, **_kw())
    text = str(err.value)
    assert "could not trace" in text and "data-dependent" in text
    assert "x.sum() > 0" in text  # the user's line
    assert "torch.where" in text and "torch.cond" in text


def test_data_dependent_shape_is_a_capture_error_suggesting_fixed_shape_masks():
    with pytest.raises(CaptureError) as err:
        compile(SelectByMask(), LOCAL2, example_inputs=(torch.randn(4, 8),))
    text = str(err.value)
    assert "data-dependent shape" in text and "boolean-mask indexing" in text
    assert "torch.where" in text


def test_a_failed_trace_prints_nothing_but_the_model_s_own_output(capfd):
    class Talks(BranchOnValues):
        def forward(self, x):
            print("from forward", file=sys.stderr)
            return super().forward(x)

    with pytest.raises(CaptureError, match="data-dependent"):
        compile(Talks(), LOCAL2, **_kw())
    out, err = capfd.readouterr()
    assert err.strip() == "from forward" and out == ""  # no tracer logs, no half-built graph


@pytest.mark.parametrize("model", [lambda t: t * 2, "model.pt", None], ids=["lambda", "str", "none"])
def test_a_model_that_is_not_a_module_is_one_typed_error(model):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for call in (lambda: compile(model, LOCAL2, example_inputs=(x,)),
                 lambda: compile(model, LOCAL2, example_inputs=(x,), example_target=y, loss_fn=F.mse_loss),
                 lambda: baselines.fsdp(model, LOCAL2, example_inputs=(x,))):
        with pytest.raises(InputError, match=r"model must be an nn.Module, got \w+: wrap a plain function"):
            call()


def test_example_inputs_of_the_wrong_type_say_how_to_pass_them():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(InputError, match=r"got a tensor: pass \(x,\)"):
        compile(mlp(), LOCAL2, example_inputs=x, example_target=y, loss_fn=F.mse_loss)
    with pytest.raises(InputError, match="must be a tuple or a dict, got int"):
        compile(mlp(), LOCAL2, example_inputs=3, example_target=y, loss_fn=F.mse_loss)
    with pytest.raises(CaptureError) as err:
        compile(mlp(), LOCAL2, example_inputs=(object(),), example_target=y, loss_fn=F.mse_loss)
    assert "inputs[0][0] has unsupported type object" in str(err.value)
    assert "pass other objects to the model's constructor" in str(err.value)


def test_example_inputs_of_the_wrong_shape_name_the_mismatch_and_the_remedy():
    with pytest.raises(CaptureError) as err:
        compile(mlp(), LOCAL2, example_inputs=(torch.randn(4, 5),), example_target=torch.randn(4, 8),
                loss_fn=F.mse_loss)
    text = str(err.value)
    assert "[4, 5] X [8, 16]" in text  # what torch saw
    assert "check that the example inputs have the shapes and dtypes forward expects" in text


def test_loss_arguments_that_do_not_fit_together_say_what_is_missing():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(InputError, match="example_target was given without loss_fn: pass loss_fn="):
        compile(mlp(), LOCAL2, example_inputs=(x,), example_target=y)
    with pytest.raises(InputError, match="loss_fn needs example_target="):
        compile(mlp(), LOCAL2, example_inputs=(x,), loss_fn=F.mse_loss)
    with pytest.raises(InputError, match="holds no loss.*pass loss_fn="):
        compile(mlp(), LOCAL2, example_inputs=(x,))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype_names_the_tensor_and_the_supported_dtypes(dtype):
    model = nn.Linear(8, 8).to(dtype)
    x = torch.randn(4, 8).to(dtype)
    with pytest.raises(UnsupportedDtypeError) as err:
        compile(model, LOCAL2, example_inputs=(x,), example_target=x,
                loss_fn=lambda a, b: (a - b).abs().float().pow(2).mean())
    text = str(err.value)
    assert f"weight has dtype {dtype}" in text and "bfloat16" in text
    assert "model.to(torch.float32)" in text


def test_complex_input_to_a_float_model_is_refused_before_tracing():
    x = torch.randn(4, 8, dtype=torch.complex64)
    with pytest.raises(UnsupportedDtypeError, match=r"input inputs\[0\]\[0\] has dtype torch.complex64"):
        compile(mlp(), LOCAL2, example_inputs=(x,), example_target=x, loss_fn=F.mse_loss)


# ----------------------------------------------------------------------------- cluster, options


def test_non_positive_cluster_sizes_are_refused_with_an_example():
    with pytest.raises(ClusterError, match=r"positive ints, e.g. \(2, 8\); got \(0,\)"):
        Cluster(mesh_shape=(0,))
    with pytest.raises(ClusterError, match="1-3 ints"):
        Cluster(mesh_shape=4)
    with pytest.raises(ClusterError, match="world_size must be a positive int, got 0"):
        Cluster.local(world_size=0)
    with pytest.raises(ClusterError, match="nodes must be a positive int"):
        Cluster.preset("dgx-a100", nodes=0)
    with pytest.raises(ClusterError, match="device_memory must be a positive number"):
        Cluster(mesh_shape=(2,), device="A100-80GB", device_memory=-1)


def test_a_mesh_that_does_not_match_the_devices_says_which_product_is_needed():
    with pytest.raises(ClusterError, match=r"mesh \(3,\) has 3 devices; this cluster has 2: pick a shape whose product is 2"):
        LOCAL2.with_mesh((3,))
    with pytest.raises(ClusterError, match="devices_per_node=3 must be a positive int dividing the 8 devices"):
        Cluster(mesh_shape=(8,), device="A100-80GB", devices_per_node=3)
    three_nodes = Cluster(mesh_shape=(3, 4), device="A100-80GB", inter_node_bandwidth=25e9)
    with pytest.raises(ClusterError, match="straddles nodes of 4 devices unevenly; choose a mesh"):
        three_nodes.with_mesh((2, 6))


def test_unknown_preset_and_device_list_the_known_ones():
    with pytest.raises(ClusterError, match=r"unknown cluster preset 'dgx-b300'; use one of \['dgx-a100'"):
        Cluster.preset("dgx-b300")
    with pytest.raises(ClusterError, match="unknown device 'TPU-v9'.*or pass a DeviceSpec"):
        Cluster(mesh_shape=(2,), device="TPU-v9")


def test_invalid_options_name_the_field_and_its_range():
    with pytest.raises(OptionsError, match=r"memory_fraction must be in \(0, 1\], got 1.5"):
        Options(memory_fraction=1.5)
    with pytest.raises(OptionsError, match="backend must be one of"):
        Options(backend="gurobi")


# ----------------------------------------------------------------------------- planning


def test_memory_no_plan_can_meet_reports_the_smallest_achievable_peak():
    tiny = Cluster(mesh_shape=(2,), device="A100-80GB", device_memory=1000)
    with pytest.raises(InfeasibleError) as err:
        compile(mlp(), tiny, **_kw())
    peak = err.value.smallest_peak
    assert peak > 1000 * 0.9
    text = str(err.value)
    assert "no plan fits the memory limit of 900 bytes per device" in text
    assert f"smallest achievable peak is {peak / 1024:.1f} KiB" in text
    assert "Use more devices" in text and "ZeRO/FSDP" in text


def test_data_parallel_baseline_refuses_a_batch_the_ranks_do_not_divide():
    with pytest.raises(BaselineError) as err:
        baselines.data_parallel(mlp(), LOCAL2, **_kw(batch=3))
    text = str(err.value)
    assert "input 'args_0' has batch 3, which does not split evenly over 2 data-parallel ranks" in text
    assert "multiple of 2" in text
    with pytest.raises(BaselineError, match="does not split evenly over 2"):
        baselines.fsdp(mlp(), LOCAL2, **_kw(batch=3))


def test_solver_time_limit_returns_the_best_plan_with_its_gap_and_a_warning():
    model, (args, kwargs) = zoo.gpt2(layers=2, batch=8)
    example = {"input_ids": args[0], **kwargs}
    cluster = Cluster.preset("dgx-a100", use_profile=False)
    options = Options(pipeline=False, search_meshes=False)
    # memory between the replicated and the fully sharded peaks: the ILP (not the exact
    # memory-free elimination) must decide, starting from the least-memory plan
    roomy = compile(model, cluster, example_inputs=example, options=options).plan.predicted_peak_memory
    lean = baselines.fsdp(model, cluster, example_inputs=example).predicted_peak_memory
    tight = dataclasses.replace(cluster, device_memory=(roomy + lean) / 2 / options.memory_fraction)
    with pytest.warns(SolverTimeLimitWarning, match=r"stopped at time_limit_s=0.001.*raise Options\(time_limit_s"):
        plan = compile(model, tight, example_inputs=example,
                       options=dataclasses.replace(options, time_limit_s=0.001)).plan
    assert plan.solver.status == "time_limit" and not plan.solver.optimal
    assert plan.predicted_peak_memory <= (roomy + lean) / 2
    assert plan.solver.gap > Options().relative_gap
    assert 0 < plan.predicted_step_time < float("inf")
    assert len(plan.parameter_placements) == len(dict(model.named_parameters()))


def test_an_op_without_a_rule_warns_by_name_and_is_planned_replicated(unruled_plan):
    _, plan, caught = unruled_plan
    assert any(issubclass(w.category, UnsupportedOpWarning) and "aten.logcumsumexp.default" in str(w.message)
               for w in caught)
    unruled = next(n for n in plan.nodes if n.op == "aten.logcumsumexp.default")
    assert unruled.inputs == ("R",) and unruled.outputs == ("R",)


# ----------------------------------------------------------------------------- plan files


def test_corrupt_plan_files_are_refused_with_a_remedy(tmp_path, mlp_plan):
    _, compiled = mlp_plan
    path = tmp_path / "plan.json"
    compiled.plan.save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # truncated
    with pytest.raises(PlanError, match="not a valid plan file .bad JSON at line .*; re-save it"):
        Plan.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(PlanError, match="must hold a JSON object"):
        Plan.load(path)
    data = json.loads(text)
    del data["nodes"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="malformed .KeyError: 'nodes'.*re-create it with plan.save"):
        Plan.load(path)
    data = json.loads(text)
    data["parameter_placements"]["fc1.weight"] = ["Q(1)"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="'fc1.weight' has placement 'Q.1.'; a plan holds S.<dim>., R or P.sum."):
        Plan.load(path)
    with pytest.raises(PlanError, match="no plan file at"):
        Plan.load(tmp_path / "missing.json")


def test_a_newer_schema_plan_asks_to_upgrade(tmp_path, mlp_plan):
    data = mlp_plan[1].plan.to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "new.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=f"schema version {SCHEMA_VERSION + 1}.*upgrade autopar"):
        Plan.load(tmp_path / "new.json")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_a_pickled_plan_is_refused_and_never_unpickled(tmp_path, protocol):
    marker = tmp_path / "unpickled"
    path = tmp_path / "plan.json"
    path.write_bytes(pickle.dumps(_Payload(str(marker)), protocol=protocol))
    with pytest.raises(PlanError, match="not a valid plan file"):
        Plan.load(path)
    assert not marker.exists()


def test_plan_save_is_atomic_a_failed_write_keeps_the_old_file(tmp_path, mlp_plan, monkeypatch):
    plan = mlp_plan[1].plan
    path = tmp_path / "plan.json"
    plan.save(path)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        dataclasses.replace(plan, name="other").save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left over
    assert Plan.load(path) == plan


def test_a_plan_for_another_model_is_refused_by_its_graph_fingerprint(mlp_plan):
    plan = mlp_plan[1].plan
    with pytest.raises(PlanError, match="different model or different input shapes.*re-plan with autopar.compile"):
        compile(mlp(hidden=32), LOCAL2, **_kw(), plan=plan)
    with pytest.raises(PlanError, match="different model or different input shapes"):
        compile(mlp(), LOCAL2, **_kw(batch=8), plan=plan)
    with pytest.raises(PlanError, match=r"the plan is for 2 devices \(mesh \(2,\)\) but the cluster has 4"):
        compile(mlp(), Cluster.local(world_size=4), **_kw(), plan=plan)


def test_a_launch_whose_world_size_differs_from_the_plan_is_refused(mlp_plan, tmp_path):
    _, compiled = mlp_plan
    with pytest.raises(AutoparError, match="runner.. needs torch.distributed initialised: launch with torchrun"):
        compiled.runner()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(PlanError, match="the plan is for 2 ranks but this launch has 1: launch with --nproc-per-node"):
            compiled.runner()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- runs that must work


class Unruled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.logcumsumexp(self.fc1(x), dim=1))  # aten.logcumsumexp has no sharding rule


@pytest.fixture(scope="module")
def unruled_plan():
    torch.manual_seed(0)
    model = Unruled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile(model, LOCAL2, **_kw())
    return model, compiled.plan, caught


def _train(programs, batches, steps):
    out = []
    for program, (inputs, target) in zip(programs, batches):
        opt = torch.optim.SGD(program.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            losses.append(float(program.step(inputs, target)))
            opt.step()
        out.append((losses, {k: v.clone() for k, v in program.full_state_dict().items()}))
    return out


@pytest.fixture(scope="module")
def runs(unruled_plan):
    unruled_model, unruled, _ = unruled_plan
    torch.manual_seed(0)
    uneven_model = mlp()
    uneven_kw = _kw(batch=3)
    uneven = compile(uneven_model, LOCAL2, **uneven_kw)
    tied_model = TiedBatchNorm().train()
    ids = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(2))
    tied = compile(tied_model, LOCAL2, plan=baselines.data_parallel(tied_model, LOCAL2, example_inputs=(ids, labels)),
                   example_inputs=(ids, labels))
    unruled_kw = _kw()
    cases = {
        "unruled": (unruled_model, compile(unruled_model, LOCAL2, **unruled_kw, plan=unruled), unruled_kw),
        "uneven": (uneven_model, uneven, uneven_kw),
        "tied": (tied_model, tied, dict(example_inputs=(ids, labels))),
    }
    programs = [c.program for _, c, _ in cases.values()]
    batches = [(kw["example_inputs"], kw.get("example_target")) for _, _, kw in cases.values()]
    got = run_on_ranks(_train, world_size=2, args=(programs, batches, 3))[0]
    return {name: (case, result) for (name, case), result in zip(cases.items(), got)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unruled", "uneven", "tied"])
def test_fallbacks_and_buffers_train_like_one_process(runs, name):
    (model, compiled, kw), (losses, state) = runs[name]
    ref_losses, ref_state = run_reference(model, inputs=kw["example_inputs"], target=kw.get("example_target"),
                                          loss_fn=kw.get("loss_fn"), steps=3, optimizer="sgd", lr=0.1,
                                          return_parameters=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]
    for key, want in ref_state.items():
        torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-6, msg=key)
    if name == "uneven":  # batch 3 on 2 ranks: autopar keeps the inputs whole
        assert compiled.plan.input_placements == {"args_0": ("R",), "target": ("R",)}
    if name == "tied":
        assert compiled.captured.tied == {"head.weight": "emb.weight"}
        assert set(compiled.plan.input_placements.values()) == {("S(0)",)}  # BatchNorm, split batch
        assert int(state["bn.num_batches_tracked"]) == 3
        assert state["head.weight"] is state["emb.weight"] or torch.equal(state["head.weight"], state["emb.weight"])
