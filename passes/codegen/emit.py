"""The passes that rewrite the annotated graph into one rank's program.

- :func:`reshard_pass` inserts the planned collectives (``meta["autopar_edges"]``) on every edge
  and the gradient-only ops (``meta["autopar_value_grad"]``) after their values;
- :func:`local_op_pass` runs a rule's local implementation where the strategy names one (a view's
  size argument is rewritten in place, which reads better than a wrapper);
- :func:`local_shape_pass` records local shapes, checks that no op still carries a global size
  it no longer has, and puts every tensor an op makes on the rank's device (the captured device,
  ``meta`` for a model captured on meta, never survives);
- :func:`program_targets_pass` lets views accept the layouts collectives produce and integer
  histograms run on the CPU;
- :func:`cleanup_pass` drops dead nodes and regenerates the code.
"""

from __future__ import annotations

import warnings

import torch
from torch.fx.graph import _register_custom_builtin
from torch.fx.node import map_aggregate, map_arg

from autopar.comm import collectives as C
from autopar.core.errors import CodegenError
from autopar.core.ir import PROGRAM_TARGETS, is_tensor_node
from autopar.core.layout import local_context
from autopar.core.placement import local_shape
from autopar.core.reshard import DEFAULT_BACKWARD
from autopar.passes.codegen.local_op import autopar_local_op

_STEP_FN = {
    "all_reduce": C.autopar_all_reduce,
    "reduce_scatter": C.autopar_reduce_scatter,
    "all_gather": C.autopar_all_gather,
    "chunk": C.autopar_chunk,
    "all_to_all": C.autopar_all_to_all,
    "to_partial": C.autopar_to_partial,
}
_VALUE_FN = {"grad_all_reduce": C.autopar_grad_all_reduce, "grad_to_partial": C.autopar_grad_to_partial}


def _register_short_names() -> None:
    """Let FX print every function an emitted program calls by its own name,
    ``autopar_all_reduce(x, axis = 0)``, rather than a module-mangled one."""
    for fn in (*C.EMITTED, autopar_local_op):
        _register_custom_builtin(fn.__name__, f"from {fn.__module__} import {fn.__name__}", fn)


_register_short_names()
# ops whose size argument (args[1]) is the output shape: rewritten to the local shape
_SIZE_ARG_OPS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.expand.default,
}
# ops that build tensors from sizes given as arguments
_FACTORY_OPS = {
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default, torch.ops.aten.zeros.default, torch.ops.aten.ones.default,
    torch.ops.aten.empty.memory_format, torch.ops.aten.full.default, torch.ops.aten.arange.default,
    torch.ops.aten.arange.start, torch.ops.aten.arange.start_step, torch.ops.aten.rand.default,
    torch.ops.aten.randn.default,
}


def _step_call(graph, value, step, backward, *, last_before_output=False):
    kwargs = {"axis": step.axis}
    if step.dim is not None:
        kwargs["dim"] = step.dim
    if step.dim2 is not None:
        kwargs["dim2"] = step.dim2
    if step.kind in DEFAULT_BACKWARD and backward is not None:  # the steps with a choice of adjoint
        kwargs["backward"] = backward
    if step.kind == "all_reduce" and last_before_output:
        kwargs["wait"] = False  # only the user reads it: let it overlap the backward
    return graph.call_function(_STEP_FN[step.kind], (value,), kwargs, name=f"{value.name}_{step.kind}")


def _insert_value_grads(graph, node, position) -> None:
    ops = node.meta.get("autopar_value_grad") or []
    if not ops:
        return
    last = node
    # A parameter's ops go just before its first use, not at the top with the placeholders:
    # autograd runs ready nodes latest-created first, so placed there the gradient all-reduce
    # starts as soon as the gradient is complete instead of after the whole backward pass.
    where = min(node.users, key=position.__getitem__) if node.op == "placeholder" and node.users else None
    for kind, axis in ops:  # every use goes through an edge, which starts from the last one
        with graph.inserting_before(where) if where is not None else graph.inserting_after(last):
            last = graph.call_function(_VALUE_FN[kind], (last,), {"axis": axis}, name=f"{node.name}_{kind}")
    node.meta["autopar_emitted"] = last


def _emit_edge(graph, consumer, edge, cache):
    key = edge.key()
    if key in cache:
        return cache[key]
    value = edge.producer.meta.get("autopar_emitted", edge.producer)
    with graph.inserting_before(consumer):
        for axis in sorted(edge.grad_all_reduce):
            # Megatron's f on one use of a parameter: its other uses hand back whole gradients,
            # so the sum must not take the parameter's whole (bucketed) gradient
            kwargs = {"axis": axis} if edge.producer.op != "placeholder" else {"axis": axis, "bucket": False}
            value = graph.call_function(C.autopar_grad_all_reduce, (value,), kwargs,
                                        name=f"{edge.producer.name}_grad_all_reduce")
        for i, (step, backward) in enumerate(zip(edge.steps, edge.backward)):
            last = consumer.op == "output" and i == len(edge.steps) - 1
            value = _step_call(graph, value, step, backward, last_before_output=last)
    cache[key] = value
    return value


def _rewrite_inputs(node, new_values) -> None:
    it = iter(new_values)

    def swap(x):
        return next(it) if is_tensor_node(x) else x

    node.args = map_arg(node.args, swap)
    node.kwargs = map_arg(node.kwargs, swap)


def reshard_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        _insert_value_grads(graph, node, position)
    cache: dict = {}
    for node in list(graph.nodes):
        edges = node.meta.get("autopar_edges")
        if not edges:
            continue
        new_values = [_emit_edge(graph, node, e, cache) for e in edges]
        _rewrite_inputs(node, new_values)
    return gm


def local_op_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    mesh = ctx.assignment.mesh_shape
    graph = gm.graph
    for node in list(graph.nodes):
        strat = node.meta.get("autopar_strategy")
        if node.op != "call_function" or strat is None or strat.local is None:
            continue
        out_shapes = [tuple(v.shape) for v in _tensor_vals(node)]
        if node.target in _SIZE_ARG_OPS and strat.local == "local_shape":
            size = list(local_shape(out_shapes[0], strat.outputs[0], mesh))
            node.args = (node.args[0], size) + tuple(node.args[2:])
            node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("size", "shape")}
            continue
        in_shapes = node.meta["autopar_input_shapes"]
        local = local_context(input_shapes=in_shapes, output_shapes=out_shapes, strategy=strat,
                              mesh_shape=mesh, coord=ctx.coord)
        attr = f"_ctx_{node.name}"
        setattr(gm, attr, local)
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # FX expects modules/tensors behind get_attr
            ctx_node = graph.get_attr(attr)
        op_name = str(node.target)  # e.g. "aten.embedding.default", resolved at run time
        node.args = (op_name, strat.local, ctx_node, tuple(node.args), dict(node.kwargs))
        node.kwargs = {}
        node.target = autopar_local_op
    return gm


def _tensor_vals(node) -> list:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    return [v for v in val if isinstance(v, torch.Tensor)] if isinstance(val, (tuple, list)) else []


def local_shape_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    mesh = ctx.assignment.mesh_shape
    device = None  # ctx.device, or a node reading the device of the program's first tensor input
    for node in list(gm.graph.nodes):
        sh = node.meta.get("autopar_sharding")
        shape = node.meta.get("autopar_shape")
        if sh is not None and shape is not None:
            node.meta["autopar_local_shape"] = local_shape(shape, sh, mesh)
            if (node.op == "call_function" and node.target in _FACTORY_OPS
                    and node.meta["autopar_local_shape"] != shape):
                raise CodegenError(
                    f"{node.name} ({node.target}) makes a tensor from global sizes but is assigned"
                    f" a sharded output; plan it replicated (its consumers can take a local slice)"
                )
        if node.op == "call_function" and _has_device((node.args, node.kwargs)):
            device = device or _rank_device(gm, ctx)
            node.args, node.kwargs = map_aggregate(
                (node.args, node.kwargs), lambda v, d=device: d if isinstance(v, torch.device) else v)
    return gm


def _has_device(args) -> bool:
    found = []
    map_aggregate(args, lambda v: found.append(v) if isinstance(v, torch.device) else None)
    return bool(found)


def _rank_device(gm: torch.fx.GraphModule, ctx):
    """``ctx.device``, or else the device of the program's first tensor input read when it runs
    (a rank's inputs and stored tensors all sit on its device)."""
    if ctx.device is not None:
        return torch.device(ctx.device)
    first = next((n for n in gm.graph.find_nodes(op="placeholder")
                  if isinstance(n.meta.get("val"), torch.Tensor)), None)
    if first is None:
        raise CodegenError("the program makes tensors on a device but takes no tensor to learn the rank's"
                           " device from: pass device= to the program")
    with gm.graph.inserting_after(first):
        return gm.graph.call_function(getattr, (first, "device"), name="rank_device")


def program_targets_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    """What the program calls for some captured ops (:data:`~autopar.core.ir.PROGRAM_TARGETS`):
    ``view`` -> ``reshape``, the same values, but it also accepts a tensor whose layout an inserted
    collective changed (eager PyTorch may have handed a view-compatible layout, e.g. a transposed
    attention output, that a gathered or sliced copy no longer has); ``histc`` -> one that also
    counts integer tensors on the CPU."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in PROGRAM_TARGETS:
            node.target = PROGRAM_TARGETS[node.target]
    return gm


def cleanup_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["cleanup_pass", "local_op_pass", "local_shape_pass", "program_targets_pass", "reshard_pass"]
