"""Capture: a model and example inputs → an ATen FX graph with shapes, module paths and layers.

:func:`capture` runs ``torch.export.export(model, args, kwargs, strict=False)`` and then
``run_decompositions({})`` (functional ATen that keeps aten.linear, layer_norm,
scaled_dot_product_attention, cross_entropy_loss, conv2d, embedding, ... whole). Export traces
with fake tensors, so nothing proportional to the model is allocated: the model may live on the
meta device and so may the inputs. The graph is planned in the model's current mode (call
``model.train()`` for a training graph)::

    model, (args, kwargs) = autopar.zoo.gpt2()
    cap = capture(model, args, kwargs=kwargs)
    cap.layers            # ('transformer.h.0', 'transformer.h.1')
    cap.tied              # {'lm_head.weight': 'transformer.wte.weight'}

Every node of ``cap.graph_module`` (a copy, independent of ``cap.exported_program``) gets

- ``meta["autopar_tensor"]``: a :class:`TensorMeta`, a tuple of them (``None`` for non-tensor
  entries) for multi-output nodes and the output node, or ``None`` for non-tensor values;
- ``meta["autopar_module"]``: the plain FQN of the module the node ran in (``""`` for the root);
  parameter and buffer placeholders get the module owning their FQN;
- ``meta["autopar_layer"]``: the repeated layer containing that module, or ``None``.

**Repeated layers.** A container (``nn.ModuleList`` or ``nn.Sequential``) holds repeated layers
when it has at least two children, every child holds at least one parameter, and all children
are structurally identical: the same class, the same submodule tree (relative names, classes and
``extra_repr()``), and parameters and buffers with the same relative names, shapes, dtypes and
requires_grad. Containers are searched outermost first; containers inside a found layer are not
searched. The children of every qualifying container are layers, named by FQN (``model.layers.17``)
and ordered by their first compute node in the graph (never-executed layers last, in module
order). A container whose children differ (e.g. a ResNet stage whose first block has a
projection shortcut) yields no layers; its parts count as pre/post parts (layer ``None``).

**Tied weights** (one ``nn.Parameter`` under several FQNs) are one parameter: the canonical FQN
is the first one ``model.named_parameters()`` yields, the graph keeps one placeholder for it and
``cap.tied`` maps every other FQN to it.

**Outputs.** A user output is a ``"loss"`` when its pytree key is ``loss`` (HF ModelOutput) or, if
no output is keyed so, when the whole model output is one 0-dim floating tensor.

**Layer stamping** (``stamp_layers=True``, the default): a container of more than three repeated
layers is traced with its first three only and the other layers' nodes are copies of the third's
(:mod:`autopar.passes.capture.stamp` says when that is exact; otherwise the model is traced whole). The
graph, inputs, outputs and meta are those of the full trace, up to compute-node names;
``cap.stamped`` names the stamped containers. LLaMA-2-70B captures in a few seconds instead of
about a minute.

**Mean losses.** Mean cross entropy is rewritten as sum / count of non-ignored targets
(:mod:`autopar.passes.capture.mean_loss`), so that it shards over the batch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings

import torch
from torch import nn
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

from autopar.core.errors import CaptureError, UnsupportedDtypeError
from autopar.core.ir import IGNORED_OPS, TensorMeta
from autopar.passes.capture import stamp
from autopar.passes.capture.graph import (
    INPUT_KIND_OF,
    OUTPUT_KINDS,
    CapturedGraph,
    GraphInput,
    GraphOutput,
    lazy_graph_module,
    tensor_meta,
)
from autopar.passes.capture.mean_loss import mean_loss_pass

log = logging.getLogger(__name__)

_SCALAR_LEAVES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)
# What cost models, sharding rules and gloo/NCCL collectives handle (complex, float8 and
# quantized tensors are not planned).
SUPPORTED_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool,
                              torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def capture(model: nn.Module, example_inputs, *, kwargs: dict | None = None,
            stamp_layers: bool = True) -> CapturedGraph:
    """Trace ``model(*example_inputs, **kwargs)`` into a :class:`CapturedGraph` with fake tensors.

    ``stamp_layers``: trace the first layers of each long run of repeated layers and copy the
    rest (see :mod:`autopar.passes.capture.stamp`); the graph equals the full trace's, or the model is
    traced in full. ``False`` always traces in full.

    Raises :class:`autopar.CaptureError` (with the tracer's reason and a hint) when the inputs
    are of the wrong type or the model cannot be traced.
    """
    args, kwargs = _check_inputs(model, example_inputs, kwargs)
    _check_dtypes(model, args, kwargs)
    ties = _tied_fqns(model)
    containers = _repeated_containers(model)
    layer_set = frozenset(c for children in containers.values() for c in children)
    traced = _stamped_trace(model, args, kwargs, ties, containers, layer_set) \
        if stamp_layers else None
    if traced is None:
        exported = _export(model, args, kwargs)
        graph_module, inputs = _dedupe_tied(exported, ties)
        _annotate(graph_module, inputs, layer_set)
        mean_loss_pass(graph_module)
        _annotate_output(graph_module)
        stamped: tuple[str, ...] = ()
    else:
        exported, graph_module, inputs, stamped = traced
    params = {i.name: i.meta for i in inputs if i.kind == "parameter"}
    buffers = {i.name: i.meta for i in inputs if i.kind == "buffer"}
    tied = {alias: canon for alias, canon in ties.items() if canon in params or canon in buffers}
    layers = _order_layers(graph_module, layer_set, model)
    outputs = _outputs(exported, graph_module)
    return CapturedGraph(graph_module=graph_module, exported_program=exported,
                         inputs=tuple(inputs), outputs=tuple(outputs), parameters=params,
                         buffers=buffers, tied=tied, layers=layers, stamped=stamped)


@contextlib.contextmanager
def quiet_torch_logs():
    """Silence torch's tracer chatter while tracing: a failed trace logs guard details at
    WARNING/ERROR and prints its half-built graph to stderr before it raises, and the
    CaptureError says what matters. Anything else written to stderr meanwhile (the model's own
    prints) is written out afterwards."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            yield
    except Exception as exc:
        partial = getattr(exc, "partial_fx_graph", None)
        text = stderr.getvalue()
        stderr = io.StringIO(text.replace(f"{partial}\n", "") if partial is not None else text)
        raise
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was
        sys.stderr.write(stderr.getvalue())


def _export(model, args, kwargs) -> torch.export.ExportedProgram:
    try:
        with quiet_torch_logs():
            exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # the tracer's failure becomes a CaptureError, chained
        raise _capture_error(exc) from exc
    try:
        with warnings.catch_warnings(), quiet_torch_logs():  # torch's deprecated pytree use while decomposing
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            return exported.run_decompositions({})
    except Exception as exc:
        raise CaptureError(
            "torch.export traced the model but functionalizing the graph failed",
            reason=_first_lines(exc),
            hint="this is an ATen-level failure in torch; note the op named above and report it",
        ) from exc


def _stamped_trace(model, args, kwargs, ties, containers, layer_set):
    """(exported, graph module, inputs, stamped containers) by layer stamping, or ``None``."""
    chosen = stamp.stampable(model, containers, ties)
    if not chosen:
        return None
    accesses: dict = {}
    try:
        with stamp.truncated(model, chosen) as accesses:
            exported = _export(model, args, kwargs)
        stamp.check_accesses(accesses)
        graph_module, inputs = _dedupe_tied(exported, ties)
        _annotate(graph_module, inputs, layer_set)
        mean_loss_pass(graph_module)  # before stamping: the small graph is cheaper to recompile
        _annotate_output(graph_module)
        specs = exported.graph_signature.output_specs
        for children in chosen.values():
            graph_module, inputs = stamp.stamp_container(graph_module, inputs, children, specs)
        stamp.check_order(model, inputs)
    except (stamp.NotStampable, CaptureError) as exc:
        refused = [f"{p}: {a['refused']}" for p, a in accesses.items() if a["refused"]]
        log.debug("layer stamping of %s falls back to a full trace: %s", sorted(chosen),
                  "; ".join(refused) or exc)
        return None
    return exported, graph_module, inputs, tuple(chosen)


def distinct_ops(captured: CapturedGraph) -> set[str]:
    """Names of the distinct ATen ops the graph calls (e.g. ``aten.linear.default``)."""
    return {
        str(n.target)
        for n in captured.graph_module.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and n.target not in IGNORED_OPS
    }


# ----------------------------------------------------------------------------- input checking


def _check_inputs(model, example_inputs, kwargs) -> tuple[tuple, dict]:
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs an nn.Module, got {type(model).__name__}",
                           hint="wrap a plain function in an nn.Module whose forward calls it")
    if isinstance(example_inputs, torch.Tensor):
        raise CaptureError("example_inputs must be a tuple of positional arguments, got a tensor",
                           hint="pass a one-element tuple: example_inputs=(x,)")
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example_inputs must be a tuple of positional arguments, got "
            f"{type(example_inputs).__name__}", hint="pass example_inputs=(x, ...) and keyword "
            "inputs as kwargs={...}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise CaptureError(f"kwargs must be a dict with str keys, got {type(kwargs).__name__}",
                           hint="pass keyword inputs as kwargs={'labels': y}")
    leaves, _ = pytree.tree_flatten_with_path((tuple(example_inputs), kwargs))
    for path, leaf in leaves:
        if not isinstance(leaf, _SCALAR_LEAVES):
            where = "inputs" + pytree.keystr(path)
            raise CaptureError(
                f"example input {where} has unsupported type {type(leaf).__name__}",
                reason="torch.export accepts only pytrees of tensors and Python scalars",
                hint="example inputs may be tensors, int/float/bool/str/None, torch.dtype/device "
                     "and tuples, lists and dicts of them (or classes registered with "
                     "torch.export.register_dataclass / torch.utils._pytree); pass other objects "
                     "to the model's constructor instead")
    return tuple(example_inputs), kwargs


def _check_dtypes(model: nn.Module, args, kwargs) -> None:
    tensors = [(f"parameter {n}", t) for n, t in model.named_parameters()]
    tensors += [(f"buffer {n}", t) for n, t in model.named_buffers()]
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), kwargs))
    tensors += [("input inputs" + pytree.keystr(p), t) for p, t in leaves if isinstance(t, torch.Tensor)]
    for what, t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedDtypeError(
                f"{what} has dtype {t.dtype}, which autopar cannot plan: its sharding rules, cost "
                "models and collectives cover float32/64, float16, bfloat16, bool and integer "
                "tensors, not complex, float8 or quantized ones",
                hint="keep parameters, buffers and inputs in a supported dtype (e.g. "
                     "model.to(torch.float32); view complex values as real pairs with "
                     "torch.view_as_real)")


def _first_lines(exc: BaseException, n: int = 4) -> str:
    """The tracer's message without the traceback: its first lines plus the user-code line."""
    lines = [ln.rstrip() for ln in str(exc).splitlines()]
    head = [ln for ln in lines if ln.strip()][:n]
    text = f"{type(exc).__name__}: " + "\n    ".join(head)
    for i, ln in enumerate(lines):  # export names the user's line that raised
        if ln.startswith("The following call raised this error"):
            text += "\n    " + "\n    ".join(x.strip() for x in lines[i + 1 : i + 3] if x.strip())
            break
    return text


def _capture_error(exc: Exception) -> CaptureError:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    message = str(exc)
    if isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in message:
        hint = ("the forward branches, loops or sizes on tensor *values* (if x.sum() > 0, "
                ".item(), .tolist(), int(t)); make it shape-only, or use torch.where / "
                "torch.cond for value-dependent branches")
    elif "Unsupported input type" in message:
        hint = ("example inputs may be tensors, Python scalars and tuples/lists/dicts of them; "
                "register other classes with torch.export.register_dataclass")
    else:
        hint = ("torch.export (non-strict) runs forward on fake tensors; check that the example "
                "inputs have the shapes and dtypes forward expects and that forward uses no "
                "tensor data (numpy conversion, printing values)")
    return CaptureError("torch.export could not trace the model", reason=_first_lines(exc),
                        hint=hint)


# ----------------------------------------------------------------------------- ties and inputs


def _tied_fqns(model: nn.Module) -> dict[str, str]:
    """alias FQN → canonical FQN for parameters (and buffers) registered under several names."""
    tied: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for fqn, tensor in named(remove_duplicate=False):
            canon = first.setdefault(id(tensor), fqn)
            if canon != fqn:
                tied[fqn] = canon
    return tied


def _dedupe_tied(exported, ties: dict[str, str]) -> tuple[torch.fx.GraphModule, list[GraphInput]]:
    """A copy of the exported graph with one placeholder per tied weight, and its inputs."""
    graph = torch.fx.Graph()
    value_remap: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(exported.graph_module.graph, value_remap)
    graph.output(out)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    specs = exported.graph_signature.input_specs
    if len(placeholders) != len(specs):
        raise CaptureError(f"exported graph has {len(placeholders)} placeholders but "
                           f"{len(specs)} input specs", hint="report this torch.export mismatch")
    by_fqn: dict[str, torch.fx.Node] = {}
    inputs: list[GraphInput] = []
    for node, spec in zip(placeholders, specs):
        kind = INPUT_KIND_OF.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported graph input kind {spec.kind} ({node.name})",
                               hint="autopar plans parameters, buffers, constants and tensors")
        name = spec.target if spec.target is not None else spec.arg.name
        canon = ties.get(name) if kind in ("parameter", "buffer") else None
        if canon is not None and canon in by_fqn:
            node.replace_all_uses_with(by_fqn[canon])
            graph.erase_node(node)
            continue
        by_fqn[name] = node
        inputs.append(GraphInput(kind, name, node.name, tensor_meta(node.meta.get("val"), node)))
    return lazy_graph_module(exported.graph_module, graph), inputs


# ----------------------------------------------------------------------------- node meta


_PATH_TOKEN = re.compile(r"\[\s*['\"]?([^\]'\"]+?)['\"]?\s*\]")


def plain_fqn(path: str) -> str:
    """Export's module path as a plain FQN: ``L['self'].h[0].attn`` → ``h.0.attn``.

    Paths that are already plain (what non-strict export writes in torch 2.13) come back unchanged.
    """
    path = re.sub(r"^(L\[['\"]self['\"]\]|L__self__|self)\.?", "", path)
    path = _PATH_TOKEN.sub(r".\1", path).replace("._modules.", ".")
    return path.strip(".").replace("..", ".")


def _module_of_fqn(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _layer_of(module: str, layers: frozenset[str]) -> str | None:
    parts = module.split(".") if module else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return None


def _annotate(gm: torch.fx.GraphModule, inputs: list[GraphInput], layers: frozenset[str]) -> None:
    by_node = {i.node: i for i in inputs}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        meta = tensor_meta(node.meta.get("val"), node)
        if node.op == "placeholder":
            inp = by_node[node.name]
            module = _module_of_fqn(inp.name) if inp.kind in ("parameter", "buffer") else ""
        else:
            stack = node.meta.get("nn_module_stack") or {}
            module = plain_fqn(list(stack.values())[-1][0]) if stack else ""
        node.meta["autopar_tensor"] = meta
        node.meta["autopar_module"] = module
        node.meta["autopar_layer"] = _layer_of(module, layers)
    _annotate_output(gm)


def _annotate_output(gm: torch.fx.GraphModule) -> None:
    node = gm.graph.output_node()
    node.meta["autopar_tensor"] = tuple(
        a.meta.get("autopar_tensor") if isinstance(a, torch.fx.Node) else None
        for a in pytree.tree_leaves(node.args))
    node.meta["autopar_module"] = ""
    node.meta["autopar_layer"] = None


# ----------------------------------------------------------------------------- repeated layers


def _signature(module: nn.Module) -> tuple:
    parts: list[tuple] = []
    for name, sub in module.named_modules():
        parts.append(("m", name, type(sub).__module__, type(sub).__qualname__, sub.extra_repr()))
    for name, p in module.named_parameters(remove_duplicate=False):
        parts.append(("p", name, tuple(p.shape), p.dtype, p.requires_grad))
    for name, b in module.named_buffers(remove_duplicate=False):
        parts.append(("b", name, tuple(b.shape), b.dtype))
    return tuple(parts)


def _repeated_containers(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Container path → the FQNs of its children, for every container of repeated layers."""
    found: dict[str, tuple[str, ...]] = {}
    for path, module in model.named_modules():
        if any(path == f or path.startswith(f + ".") for c in found.values() for f in c):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        if not all(any(True for _ in c.parameters()) for _, c in children):
            continue
        first = _signature(children[0][1])
        if all(_signature(c) == first for _, c in children[1:]):
            found[path] = tuple(f"{path}.{name}" if path else name for name, _ in children)
    return found


def _order_layers(gm: torch.fx.GraphModule, layers: frozenset[str], model: nn.Module
                  ) -> tuple[str, ...]:
    module_order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    first_use: dict[str, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        layer = node.meta.get("autopar_layer")
        if node.op == "call_function" and layer is not None:
            first_use.setdefault(layer, i)
    never = len(gm.graph.nodes)
    return tuple(sorted(layers, key=lambda p: (first_use.get(p, never), module_order[p])))


# ----------------------------------------------------------------------------- outputs


def _leaf_names(spec, prefix: str = "") -> list[str]:
    if spec.is_leaf():
        return [prefix or "output"]
    ctx = spec.context
    n = spec.num_children
    if isinstance(ctx, (list, tuple)) and len(ctx) == n and all(isinstance(k, str) for k in ctx):
        keys = [f"{prefix}.{k}" if prefix else k for k in ctx]
    elif isinstance(ctx, type) and len(getattr(ctx, "_fields", ())) == n:  # namedtuple
        keys = [f"{prefix}.{k}" if prefix else k for k in ctx._fields]
    else:
        keys = [f"{prefix}[{i}]" for i in range(n)]
    return [name for child, key in zip(spec.children(), keys) for name in _leaf_names(child, key)]


def _outputs(exported, gm: torch.fx.GraphModule) -> list[GraphOutput]:
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(pytree.tree_leaves(out_node.args))
    specs = exported.graph_signature.output_specs
    user_names = iter(_leaf_names(exported.call_spec.out_spec))
    outputs: list[GraphOutput] = []
    for spec, value in zip(specs, values):
        node = value if isinstance(value, torch.fx.Node) else None
        meta = node.meta.get("autopar_tensor") if node is not None else None
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(GraphOutput("user_output", next(user_names, "output"),
                                       node.name if node else None, meta))
        else:
            kind = spec.kind.name.lower()
            outputs.append(GraphOutput(kind if kind in OUTPUT_KINDS else "user_output",
                                       spec.target or spec.arg.name,
                                       node.name if node else None, meta))
    user = [o for o in outputs if o.kind == "user_output"]
    keyed = [o for o in user if o.name.rsplit(".", 1)[-1] == "loss"]
    if not keyed and len(user) == 1 and user[0].name == "output":
        meta = user[0].meta
        if isinstance(meta, TensorMeta) and meta.ndim == 0 and meta.dtype.is_floating_point:
            keyed = user
    loss_ids = {id(o) for o in keyed}
    return [GraphOutput("loss", o.name, o.node, o.meta) if id(o) in loss_ids else o
            for o in outputs]


__all__ = ["CapturedGraph", "GraphInput", "GraphOutput", "capture", "distinct_ops", "plain_fqn"]
