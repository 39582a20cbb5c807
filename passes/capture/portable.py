"""Integer histograms made portable: ``histc`` of an integer tensor becomes ``histc`` of it cast to
float64, its counts cast back to the integer dtype.

transformers' sorted experts count the tokens per expert with ``histc``; on CUDA, and on meta
where a full-size model is captured, they call it on int32 expert ids, which the CPU kernel (and
the fake kernel on a CPU device) refuses: ``"histogram_cpu" not implemented for 'Int'``. So the
captured program could run neither on gloo ranks nor under verify's fake tensors. float64 holds
every int32 exactly (and every int64 up to 2**53), so the counts are the same.
"""

from __future__ import annotations

import torch

from autopar.passes.capture.copies import call_like, rewrite_calls

aten = torch.ops.aten


def portable_histc_pass(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite ``graph_module``'s integer ``histc`` nodes in place; the count rewritten."""
    return rewrite_calls(graph_module, aten.histc.default, _float_histc)


def _float_histc(graph, node):
    x = node.args[0]
    val, counts = x.meta.get("val"), node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or not isinstance(counts, torch.Tensor):
        return None
    wide = call_like(graph, node, aten._to_copy.default, (x,), {"dtype": torch.float64}, val.to(torch.float64))
    hist = call_like(graph, node, aten.histc.default, (wide, *node.args[1:]), dict(node.kwargs),
                     counts.to(torch.float64))
    return call_like(graph, node, aten._to_copy.default, (hist,), {"dtype": counts.dtype}, counts)


__all__ = ["portable_histc_pass"]
