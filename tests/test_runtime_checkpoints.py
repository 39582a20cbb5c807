"""Activation offload: under full recompute the layers' checkpoints wait on the host between
forward and backward (``Plan.offload_activations``; :class:`autopar.runtime.recompute.CheckpointHost`):
the search takes it only where recompute alone does not fit and it is the fastest saver that
does, and verify measures the device and the host as predicted. Training against one process is
in ``test_runtime_fetch.py`` (one spawn for every offload).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import Cluster, Options, compile, zoo
from autopar.core.errors import CodegenError, PlanError
from autopar.plan.assignment import assignment_of
from autopar.runtime.program import DistributedProgram
from autopar.runtime.recompute import CheckpointHost
from autopar.runtime.verify.report import PEAK_RTOL

A100 = Cluster.preset("dgx-a100", nodes=1, use_profile=False)
ONE = dataclasses.replace(A100, mesh_shape=(1,), devices_per_node=1)


@pytest.fixture(scope="module")
def llama():
    model, (args, kwargs) = zoo.llama(layers=4, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=32000, seq=1024,
                                      batch=8, device="meta")
    return model, {"input_ids": args[0], **kwargs}


@pytest.fixture(scope="module")
def kept(llama):
    """Recomputing, everything kept on the device."""
    return _compiled(llama, ONE, offload=False)


def _compiled(llama, cluster, **options):
    model, inputs = llama
    return compile(model, cluster, example_inputs=inputs,
                   options=Options(mixed_precision=True, memory_fraction=1.0, recompute=True, **options))


def test_checkpoints_go_to_the_host_only_where_recompute_alone_does_not_fit(llama, kept):
    kept = kept.plan
    assert kept.recompute is True and not kept.offload_activations
    # a layer's input, bf16: 8 x 1024 x 1024 x 2 bytes, for each of the 4 layers
    checkpoints = 4 * 8 * 1024 * 1024 * 2
    tight = dataclasses.replace(ONE, device_memory=kept.predicted_peak_memory - checkpoints / 2)
    compiled = _compiled(llama, tight)
    plan = compiled.plan
    assert plan.offload_activations and plan.recompute is True and not plan.offload
    assert plan.host_memory == pytest.approx(checkpoints)
    assert plan.predicted_peak_memory == pytest.approx(kept.predicted_peak_memory - checkpoints, rel=0.01)
    # each checkpoint down in forward and up in backward, on the compute stream
    assert plan.time.offload == pytest.approx(2 * checkpoints / ONE.host_link_bandwidth)
    (why,) = [w for w in plan.why if w.startswith("checkpoints offloaded:")]  # recompute was asked for
    assert "no plan fits the devices'" in why and "recompute and optimizer offloaded instead:" in why
    assert "recompute and parameters offloaded instead:" in why
    assert "checkpoints offloaded: the layers' inputs kept for recomputation wait on the host" in " ".join(
        plan.summary().split())
    (rank,) = compiled.verify().ranks
    assert rank.measured.host_peak == pytest.approx(checkpoints, rel=0.01)
    assert abs(rank.peak_ratio - 1) <= PEAK_RTOL and not rank.problems(), rank.problems()


def test_a_checkpoint_goes_down_once_per_forward_and_a_freed_ones_key_is_not_reused():
    host = CheckpointHost(torch.device("cpu"))
    x = torch.randn(3, 2)
    down = host.down(x)
    assert host.down(x) is down and torch.equal(down, x) and down.data_ptr() != x.data_ptr()
    assert host.down(x[1:]) is not down  # another view, another copy
    host.clear()
    assert host.down(x) is not down


def test_offloaded_checkpoints_need_full_recompute(llama, kept):
    compiled = kept
    with pytest.raises(PlanError, match="offload_activations"):
        dataclasses.replace(compiled.plan, recompute="selective", offload_activations=True)
    with pytest.raises(CodegenError, match="recompute=True"):
        DistributedProgram(compiled.captured, assignment_of(compiled.plan, compiled.captured), model=llama[0],
                           recompute="selective", offload_activations=True)
