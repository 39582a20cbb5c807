"""Activation recomputation as a stage of the plan asks for it (``Stage.recompute``).

:func:`recompute_layers` cuts a rank's emitted program into its contiguous runs of nodes, by the
repeated layer each node comes from (``meta["autopar_layer"]``, kept by code generation; the
collectives inserted inside a layer belong to it: :mod:`autopar.core.recompute`), and
runs every layer's run under torch's non-reentrant :func:`torch.utils.checkpoint.checkpoint`:
forward keeps only each layer's inputs, and backward runs the layer's forward again (its
collectives included, under the rank's mesh) the first time it needs a tensor of it, up to its
last op that saves a tensor. That is what the planner prices under recomputation
(:func:`autopar.core.recompute.rerun`), with each layer's input kept per micro-batch in flight.
Nodes outside the repeated layers (embeddings, the head, the loss) are kept as without
recomputation. Dropout draws the same numbers both times (the checkpoint restores the RNG state).
Selective recomputation checkpoints each run of a layer between its matmuls, convolutions and
attention kernels instead, and runs those ops as without recomputation
(:func:`autopar.core.recompute.keeps_output`).

With the checkpoints offloaded (``Plan.offload_activations``, a :class:`CheckpointHost`) each
layer's inputs made by the forward (activations, not parameters or buffers) are copied to the
host before the layer runs, and the checkpoint keeps the host copies: the device copy is freed
once the forward is past it, and backward's recomputation copies it back. An input several layers
read (rotary tables) goes down once per forward.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from autopar.comm.collectives import use_mesh
from autopar.comm.mesh import RankMesh
from autopar.comm.regather import regather_source
from autopar.core.recompute import node_layers, program_nodes


class CheckpointHost:
    """Where a program's checkpoints go between forward and backward: ``device`` the host, one
    copy per input and forward (:meth:`clear` at the forward's end)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._down: dict = {}  # view key -> (weak reference to its storage, the host copy made this forward)

    def down(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        entry = self._down.get(key)
        if entry is None or entry[0]() is not storage:  # a freed storage's key is reused
            entry = self._down[key] = (weakref.ref(storage), t.to(self.device, copy=True))
        return entry[1]

    def clear(self) -> None:
        self._down.clear()


class RecomputedLayer(nn.Module):
    """One layer's part of a program, recomputed in backward under ``mesh``; ``host``: its inputs
    made by the forward kept on the host in between (:class:`CheckpointHost`)."""

    def __init__(self, part: torch.fx.GraphModule, mesh: RankMesh, grad_hooks: dict,
                 host: CheckpointHost | None = None):
        super().__init__()
        self.part = part
        self._mesh = mesh
        self._grad_hooks = grad_hooks
        self._host = host

    def _run(self, *args):
        with use_mesh(self._mesh, self._grad_hooks):  # the recomputation runs in backward, outside forward's
            return self.part(*args)

    def _run_back(self, devices, *args):
        return self._run(*(a.to(d, copy=True) if d is not None else a for a, d in zip(args, devices)))

    def forward(self, *args):
        if self._host is None:
            return checkpoint(self._run, *args, use_reentrant=False)
        moved = [isinstance(a, torch.Tensor) and a.grad_fn is not None and regather_source(a) is None for a in args]
        devices = [a.device if m else None for a, m in zip(args, moved)]
        args = [self._host.down(a) if m else a for a, m in zip(args, moved)]
        return checkpoint(self._run_back, devices, *args, use_reentrant=False)


def layer_runs(program: torch.fx.GraphModule, *, selective: bool = False) -> dict[str, tuple[int, str | None]]:
    """``node name -> (run index, layer or None)``: consecutive nodes of one layer share a run
    (a collective code generation put between them included: :func:`~autopar.core.recompute.node_layers`;
    ``selective``: of one segment of a layer, None for its kept ops)."""
    nodes = program_nodes(program.graph)
    runs, index, previous = {}, -1, object()
    for node, layer in zip(nodes, node_layers(nodes, selective=selective)):
        if layer != previous:
            index, previous = index + 1, layer
        runs[node.name] = (index, layer)
    return runs


def recompute_layers(program: torch.fx.GraphModule, mesh: RankMesh, grad_hooks: dict, *,
                     selective: bool = False, host: CheckpointHost | None = None) -> nn.Module:
    """``program`` with each of its layers' runs (``selective``: each segment of them between
    kept ops) recomputed in backward (module docstring; ``host``: their checkpoints offloaded there);
    ``program`` itself when it has none."""
    runs = layer_runs(program, selective=selective)
    if not any(layer is not None for _, layer in runs.values()):
        return program
    split = split_module(program, program, lambda node: runs[node.name][0], keep_original_order=True)
    layered = {index for index, layer in runs.values() if layer is not None}
    for name, part in list(split.named_children()):
        if int(name.removeprefix("submod_")) in layered:
            setattr(split, name, RecomputedLayer(part, mesh, grad_hooks, host))
    return split


__all__ = ["CheckpointHost", "RecomputedLayer", "layer_runs", "recompute_layers"]
