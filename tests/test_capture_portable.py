"""Integer histograms made portable (passes/capture/portable.py): a model captured on meta that
counts int32 ids with ``histc`` (transformers' sorted experts do, on any device but the CPU) gives
a program whose CPU kernels accept it, with the same counts, and verify runs its plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.passes.capture import capture
from autopar.passes.capture.portable import portable_histc_pass


class Counts(nn.Module):
    def forward(self, ids):
        return torch.histc(ids, bins=6, min=0, max=5) * 2


def test_an_integer_histc_runs_on_the_cpu_with_the_same_counts():
    ids = torch.tensor([[0, 5, 5, 2], [2, 2, 7, 1]], dtype=torch.int32)  # 7: out of range, not counted
    with pytest.raises(RuntimeError, match="histogram_cpu"):
        Counts()(ids)
    gm = torch.export.export(Counts(), (ids.to("meta"),)).graph_module
    assert portable_histc_pass(gm) == 1
    histcs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert [n.args[0].meta["val"].dtype for n in histcs] == [torch.float64]
    got = gm(ids)[0]
    assert got.dtype == torch.int32
    assert got.tolist() == [2, 2, 6, 0, 0, 4]  # ids 0, 1, 2 (three), 5 (two); times 2
    assert portable_histc_pass(gm) == 0  # float histograms are left alone


def test_capture_rewrites_integer_histograms():
    cap = capture(Counts(), (torch.zeros(2, 4, dtype=torch.int32, device="meta"),))
    histcs = [n for n in cap.graph_module.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert histcs and all(n.args[0].meta["val"].dtype == torch.float64 for n in histcs)


pytest.importorskip("transformers")


def test_verify_runs_a_sorted_experts_plan_captured_on_meta():
    """transformers' sorted experts on meta count int32 ids; verify's fake CPU step used to stop
    there (``"histogram_cpu" not implemented for 'Int'``)."""
    import autopar
    from autopar import Cluster
    from autopar.core.options import Options
    from autopar.zoo_hf import architectures, build

    arch = next(a for a in architectures() if a.class_name == "MixtralForCausalLM")
    model, inputs = build(arch, experts=True, batch=4, seq=32, device="meta")
    compiled = autopar.compile(model, Cluster.local(2), example_inputs=inputs, options=Options(moe_dispatch="sorted"))
    assert any(n.target is torch.ops.aten.histc.default for n in compiled.captured.graph_module.graph.nodes)
    report = compiled.verify()
    assert report.ok, report.table()
