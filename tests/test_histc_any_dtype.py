"""Integer histograms on the CPU (``core.ir.histc_any_dtype``, which programs call for
``aten.histc``): a model captured on meta that counts int32 ids with ``histc`` (transformers'
sorted experts do, on any device but the CPU) gives a program whose CPU kernels accept it, with
the same counts, and verify runs its plan. The captured graph, which planning reads, is left as
the model traced it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.core.ir import histc_any_dtype
from autopar.passes.capture import capture


class Counts(nn.Module):
    def forward(self, ids):
        return torch.histc(ids, bins=6, min=0, max=5) * 2


def test_an_integer_histc_runs_on_the_cpu_with_the_same_counts():
    ids = torch.tensor([[0, 5, 5, 2], [2, 2, 7, 1]], dtype=torch.int32)  # 7: out of range, not counted
    with pytest.raises(RuntimeError, match="histogram_cpu"):
        Counts()(ids)
    got = histc_any_dtype(ids, 6, 0, 5)
    assert got.dtype == torch.int32
    assert got.tolist() == [1, 1, 3, 0, 0, 2]
    floats = torch.randn(50)
    assert torch.equal(histc_any_dtype(floats, 8, -2, 2), torch.histc(floats, 8, -2, 2))


def test_capture_keeps_the_models_histc():
    cap = capture(Counts(), (torch.zeros(2, 4, dtype=torch.int32, device="meta"),))
    histcs = [n for n in cap.graph_module.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert [n.args[0].meta["val"].dtype for n in histcs] == [torch.int32]


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
