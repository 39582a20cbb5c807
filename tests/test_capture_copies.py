"""Functional copies (``aten.copy``) rewritten into differentiable ops (passes/capture/copies.py)."""

from __future__ import annotations

import torch
from torch import nn

from autopar.passes.capture.copies import differentiable_copies_pass


class _CopyInto(nn.Module):
    """``out.copy_(w)``: a float32 (4,) parameter broadcast into a float64 (2, 3, 4) buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        out = torch.zeros(2, 3, 4, dtype=torch.float64)
        out.copy_(self.w)
        return (out * x).sum()


def test_a_copy_into_a_buffer_becomes_a_cast_broadcast_clone_with_the_gradient_of_its_source():
    torch.manual_seed(0)
    model, x = _CopyInto(), torch.randn(2, 3, 4, dtype=torch.float64)
    gm = torch.export.export(model, (x,), strict=False).run_decompositions({}).graph_module
    assert torch.ops.aten.copy.default in {n.target for n in gm.graph.nodes}
    assert differentiable_copies_pass(gm) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.copy.default not in ops
    assert {torch.ops.aten._to_copy.default, torch.ops.aten.expand.default, torch.ops.aten.clone.default} <= set(ops)
    w = model.w.detach().clone().requires_grad_()
    (loss,) = gm(w, x)
    loss.backward()  # aten.copy has no derivative: this raised before the rewrite
    model(x).backward()
    assert torch.equal(loss, model(x).detach()) and torch.allclose(w.grad, model.w.grad)
