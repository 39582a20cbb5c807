"""Ship an emitted GraphModule to another process: FX graphs and ATen ops do not pickle.

:func:`pack` turns a GraphModule into plain data (nodes as tuples, ATen ops by name, the
attributes ``get_attr`` nodes read, the node metadata the runtime reads: :data:`KEPT_META`, and
the Python modules whose import registers the custom ops it calls, such as
``transformers.integrations.moe`` for ``transformers::grouped_mm_fallback``); :func:`unpack`
imports those modules and rebuilds it with the same node names, so the code a worker runs is the
code :meth:`DistributedProgram.code` shows.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch._library.custom_ops import OPDEFS

from autopar.core.errors import AutoparError

_NODE, _OP = "__autopar_node__", "__autopar_op__"
KEPT_META = ("autopar_layer",)  # the repeated layer of a node (activation recomputation)


def _op_name(op: torch._ops.OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"  # "aten::linear.default"


def _defining_module(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers ``op``: a ``torch.library.custom_op``'s own module, else
    the package named like the op's namespace (None: torch's own ops)."""
    opdef = OPDEFS.get(op._schema.name)
    if opdef is not None:
        return opdef._init_fn.__module__
    namespace = op._schema.name.split("::")[0]
    return namespace if _importable(namespace) else None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _resolve_op(name: str):
    qualified, overload = name.rsplit(".", 1)
    namespace, op = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _pack_value(x):
    if isinstance(x, torch.fx.Node):
        return (_NODE, x.name)
    if isinstance(x, torch._ops.OpOverload):
        return (_OP, _op_name(x))
    if isinstance(x, (list, tuple)):
        packed = [_pack_value(v) for v in x]
        return packed if isinstance(x, list) else tuple(packed)
    if isinstance(x, dict):
        return {k: _pack_value(v) for k, v in x.items()}
    return x


def _unpack_value(x, env):
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _NODE:
        return env[x[1]]
    if isinstance(x, tuple) and len(x) == 2 and x[0] == _OP:
        return _resolve_op(x[1])
    if isinstance(x, (list, tuple)):
        items = [_unpack_value(v, env) for v in x]
        return items if isinstance(x, list) else tuple(items)
    if isinstance(x, dict):
        return {k: _unpack_value(v, env) for k, v in x.items()}
    return x


def pack(gm: torch.fx.GraphModule) -> dict:
    """Plain, picklable data describing ``gm``'s graph and the attributes it reads."""
    nodes, attrs, modules = [], {}, set()
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            modules.add(_defining_module(target))
            target = (_OP, _op_name(target))
        elif node.op == "get_attr":
            attrs[target] = getattr(gm, target)
        meta = {k: node.meta[k] for k in KEPT_META if k in node.meta}
        nodes.append((node.op, node.name, target, _pack_value(node.args), _pack_value(node.kwargs), meta))
    return {"nodes": nodes, "attrs": attrs, "modules": sorted(modules - {None})}


def unpack(data: dict) -> torch.fx.GraphModule:
    """The GraphModule :func:`pack` described."""
    for module in data["modules"]:
        importlib.import_module(module)
    root = torch.nn.Module()
    for name, value in data["attrs"].items():
        setattr(root, name, value)
    graph = torch.fx.Graph()
    env: dict = {}
    for op, name, target, args, kwargs, meta in data["nodes"]:
        if isinstance(target, tuple) and target[0] == _OP:
            target = _resolve_op(target[1])
        args, kwargs = _unpack_value(args, env), _unpack_value(kwargs, env)
        node = graph.create_node(op, target, args, kwargs, name=name)
        node.meta.update(meta)
        if node.name != name:
            raise AutoparError(f"node {name} came back as {node.name} when rebuilding a program")
        env[name] = node
    return torch.fx.GraphModule(root, graph)


__all__ = ["pack", "unpack"]
