"""Repeated layers: the identical children of a container, found on the module tree.

A container (``nn.ModuleList`` or ``nn.Sequential``) holds repeated layers when it has at least
two children, every child holds at least one parameter, and all children are structurally
identical: the same class, the same submodule tree (relative names, classes and
``extra_repr()``), and parameters and buffers with the same relative names, shapes, dtypes and
requires_grad. Containers are searched outermost first; containers inside a found layer are not
searched. The children of every qualifying container are layers, named by FQN
(``model.layers.17``) and ordered by their first compute node in the graph (never-executed
layers last, in module order). A **hybrid stack** holds layers too: children of a few kinds, each
kind repeated (every child identical to at least one other), as the interleaved Mamba and
attention layers of Zamba, Jamba or Qwen3-Next; its layers are recompute regions and pipeline
cut points, stamped by their period where they repeat (:mod:`~autopar.passes.capture.stamp`),
and the pipeline search prices them as differing layers. So
does a stack that is one of these after a prefix of at most a quarter of its children, each
of any kind (DeepSeek-V3's and GLM-4.5's dense layers before their routed-experts ones; T5's
first block with its relative position bias; a ResNet stage of more than three blocks, the
first with a projection shortcut). Any other container with a child unlike every other (a
ResNet stage of three blocks) yields no layers; its parts count as pre/post parts (layer ``None``).

**Repeated blocks** (:func:`repeated_blocks`) are what identical decisions are shared over, a
wider net than layers: in every container the children fall into classes of identical children
(the same test), and each class of at least two children with parameters is a group of blocks,
whether or not the container's other children differ: T5's encoder blocks 1–5 (block 0 alone
holds the relative position bias), and its decoder blocks 1–5, are two groups. Containers inside
a block are not searched.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn


def signature(module: nn.Module) -> tuple:
    """What two structurally identical modules share (module docstring): classes, relative names, shapes."""
    parts: list[tuple] = []
    for name, sub in module.named_modules():
        parts.append(("m", name, type(sub).__module__, type(sub).__qualname__, sub.extra_repr()))
    for name, p in module.named_parameters(remove_duplicate=False):
        parts.append(("p", name, tuple(p.shape), p.dtype, p.requires_grad))
    for name, b in module.named_buffers(remove_duplicate=False):
        parts.append(("b", name, tuple(b.shape), b.dtype))
    return tuple(parts)


def repeated_containers(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Container path → the FQNs of its children, for every container of repeated layers: all
    alike, or a hybrid stack (:func:`is_hybrid`)."""
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
        if any(_repeats(children[k:]) for k in prefix_lengths(len(children))):
            found[path] = tuple(f"{path}.{name}" if path else name for name, _ in children)
    return found


def prefix_lengths(n: int) -> range:
    """The lengths a stack of ``n`` children's prefix may have before its layers: none, or at
    most a quarter of the stack."""
    return range(n // 4 + 1)


def _repeats(children: list[tuple[str, nn.Module]]) -> bool:
    """Whether ``children`` (at least two) are all alike, or of a few kinds each repeated."""
    kinds = Counter(signature(c) for _, c in children)
    return len(children) >= 2 and (len(kinds) == 1 or min(kinds.values()) >= 2)


def repeated_blocks(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of identical children (FQNs, module order) of every container, outermost first
    (module docstring); a model's layers are the groups that fill a container."""
    groups: list[tuple[str, ...]] = []
    inside: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        if path in inside or any(path.startswith(b + ".") for b in inside):
            continue
        classes: dict[tuple, list[str]] = {}
        for name, child in module.named_children():
            if any(True for _ in child.parameters()):
                classes.setdefault(signature(child), []).append(f"{path}.{name}" if path else name)
        for members in classes.values():
            if len(members) >= 2:
                groups.append(tuple(members))
                inside.update(members)
    return tuple(groups)


def layer_of(module: str, layers: frozenset[str]) -> str | None:
    """The layer holding the module at FQN ``module`` (the layer itself or an ancestor), or ``None``."""
    parts = module.split(".") if module else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return None


def order_layers(gm: torch.fx.GraphModule, layers: frozenset[str], model: nn.Module
                 ) -> tuple[str, ...]:
    """``layers`` in the order of their first compute node in ``gm`` (unused ones last)."""
    module_order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    first_use: dict[str, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        layer = node.meta.get("autopar_layer")
        if node.op == "call_function" and layer is not None:
            first_use.setdefault(layer, i)
    never = len(gm.graph.nodes)
    return tuple(sorted(layers, key=lambda p: (first_use.get(p, never), module_order[p])))


__all__ = ["layer_of", "order_layers", "repeated_blocks", "repeated_containers", "signature"]
