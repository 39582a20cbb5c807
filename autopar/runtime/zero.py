"""ZeRO-1 and ZeRO-2 as planned: optimizer state (ZeRO-2: gradients too) sharded over the
data-parallel axes of a one-program plan or of a pipeline stage (ZeRO-1, see :class:`ZeroShards`).

A parameter's **ZeRO axes** are the mesh axes over which the emitted program sums its gradient
as data parallelism does (a bucketed ``autopar_grad_all_reduce`` on the parameter itself, see
:func:`emitted_zero_axes`): it is stored whole on them and every coordinate ends the backward with the
same summed gradient. Over those axes each rank keeps a **shard**: this rank's piece of the
parameter flattened, zero-padded to a multiple of ``n`` (the axes' sizes multiplied) and cut into
``n`` contiguous chunks, chunk ``c`` for the rank at row-major coordinate ``c`` of the axes.
Flattened chunks rather than dim-0 slices, because every shape then splits evenly (a bias of 3
on 4 ranks, a dim 0 smaller than the axis) and a parameter stays one tensor of the user's
optimizer. The shard is what the optimizer steps (fp32 under mixed precision: the fp32 masters
exist only as shards), so its state is one process's state for those elements; padding holds
zeros with zero gradients, which SGD and AdamW leave at zero.

A step: ZeRO-1 lets the program all-reduce the gradient as before and moves this rank's chunk of
it into the shard's ``.grad`` (:meth:`ZeroShards.take_gradients`); ZeRO-2 reduce-scatters each
gradient as soon as backward produces it, so no summed gradient is ever whole
(:func:`~autopar.comm.buckets.scatter_parameter`). After the optimizer's step,
:meth:`ZeroShards.refresh` all-gathers the updated shards into the program's parameters (in the
program's dtype), before the next forward. Gradient accumulation adds into the shards' ``.grad``
until the optimizer's ``zero_grad``.

Parameters without ZeRO axes (sharded on every axis the gradient is summed over, frozen,
integer) keep what :mod:`autopar.runtime.mixed` gives them: an fp32 master under mixed
precision, else the program's own parameter.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from autopar.comm.buckets import scatter_parameter
from autopar.comm.collectives import autopar_grad_all_reduce
from autopar.comm.mesh import RankMesh
from autopar.comm.plain import all_gather, reduce_scatter
from autopar.core.errors import CodegenError
from autopar.core.placement import Shard
from autopar.plan.zero import LEVELS


def check_level(zero: int) -> int:
    """``zero`` if it is a level of :data:`LEVELS`, else CodegenError."""
    if zero not in LEVELS:
        raise CodegenError(f"zero must be one of {LEVELS} for a program (ZeRO-3 is a plan whose parameters are"
                           f" stored sharded: autopar.baselines.fsdp), got {zero!r}")
    return zero


def emitted_zero_axes(program: torch.fx.GraphModule, stored_of: dict) -> dict[str, tuple[int, ...]]:
    """FQN -> the mesh axes (ascending) over which ``program`` sums that parameter's gradient
    with a bucketed gradient all-reduce on the placeholder itself (``stored_of``: placeholder
    node name -> FQN of a trainable parameter)."""
    axes: dict[str, set] = {}
    for node in program.graph.nodes:
        if node.target is not autopar_grad_all_reduce or not node.kwargs.get("bucket", True):
            continue
        source = node.args[0]
        while source.op == "call_function" and source.target is autopar_grad_all_reduce:
            source = source.args[0]
        if source.op == "placeholder" and source.name in stored_of:
            axes.setdefault(stored_of[source.name], set()).add(node.kwargs["axis"])
    return {fqn: tuple(sorted(a)) for fqn, a in axes.items()}


def stepped_piece(masters, fqn: str, working) -> torch.Tensor:
    """What the optimizer steps for stored tensor ``fqn``, as a piece of its storage sharding
    (``masters``: a :class:`ZeroShards`, a :class:`~autopar.runtime.mixed.MasterWeights` or None;
    ``working(fqn)``: the program's tensor): its ZeRO shards gathered (collective), its master,
    else the program's tensor."""
    if isinstance(masters, ZeroShards) and fqn in masters.shards:
        return masters.piece(fqn)
    stepped = masters.stepped_tensor(fqn) if masters is not None else None
    return stepped if stepped is not None else working(fqn)


class ZeroShards:
    """One rank's optimizer-state shards (see the module docstring).

    ``axes``: FQN -> ZeRO axes of each parameter to shard; ``working(fqn)``: the program's
    parameter; ``masters``: the :class:`~autopar.runtime.mixed.MasterWeights` under mixed
    precision (the shards are cut from them, and they are dropped: the remaining masters are
    those of parameters without ZeRO axes), else None; ``level``: 1 or 2; ``grad_hooks``: the
    running module's gradient hooks (ZeRO-2 hooks its parameters there); ``scatter``: whether the
    gradient sums are reduce-scatters into the shards (default: at ZeRO-2). A pipeline's ZeRO-1
    passes True: its sums run once per step
    (:func:`~autopar.comm.buckets.deferred_gradient_sums`) on the gradient each rank added up
    over the micro-batches, whole as ZeRO-1 holds it, so reduce-scattering that sum moves half an
    all-reduce's bytes and leaves the same shards.
    """

    def __init__(self, axes: dict, working, masters, mesh: RankMesh, level: int, grad_hooks: dict, *,
                 scatter: bool | None = None):
        self.level = check_level(level)
        self.masters = masters
        self._working = working
        self._mesh = mesh
        self._axes = {fqn: tuple(a for a in ax if mesh.mesh_shape[a] > 1) for fqn, ax in axes.items()}
        self._axes = {fqn: ax for fqn, ax in self._axes.items() if ax}
        self.shards: dict[str, nn.Parameter] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._gathered: dict[str, int] = {}  # FQN -> the shard's version last gathered
        for fqn, ax in self._axes.items():
            full = masters.masters.pop(fqn) if masters is not None else working(fqn)
            self._shapes[fqn] = full.shape
            self.shards[fqn] = nn.Parameter(self._chunk(full.detach(), ax).clone())
            self._gathered[fqn] = self.shards[fqn]._version
            if (self.level == 2) if scatter is None else scatter:
                scatter_parameter(grad_hooks, working(fqn), self._scatterer(fqn))

    def _chunk(self, full: torch.Tensor, axes) -> torch.Tensor:
        """This rank's chunk of ``full`` flattened and padded over ``axes``."""
        n = math.prod(self._mesh.mesh_shape[a] for a in axes)
        flat = _padded(full.reshape(-1), n)
        size = flat.numel() // n
        index = 0
        for a in axes:
            index = index * self._mesh.mesh_shape[a] + self._mesh.coord[a]
        return flat[index * size:(index + 1) * size]

    def _scatterer(self, fqn: str):
        """ZeRO-2's hook body: add this rank's chunk of the sum over the ZeRO axes of a gradient
        ``g`` of parameter ``fqn`` into its shard's ``.grad``."""
        shard, axes = self.shards[fqn], self._axes[fqn]

        def scatter(g: torch.Tensor) -> None:
            flat = _padded(g.reshape(-1), math.prod(self._mesh.mesh_shape[a] for a in axes))
            for a in axes:  # outer axis first: the chunk at row-major coordinate c remains
                flat = reduce_scatter(flat, self._mesh.axis(a), 0)
            _add_grad(shard, flat)

        return scatter

    def stepped(self, working, parameters) -> list[torch.Tensor]:
        """What the optimizer steps (``parameters``: the FQNs of the program's parameters): the
        shards, then the masters (mixed precision) or the program's parameters of the rest."""
        rest = (list(self.masters.masters.values()) if self.masters is not None
                else [working(fqn) for fqn in parameters if fqn not in self.shards])
        return list(self.shards.values()) + rest

    def owned(self) -> list[torch.Tensor]:
        """The optimizer's own copies of parameters: the shards and the remaining masters."""
        return list(self.shards.values()) + (list(self.masters.masters.values()) if self.masters is not None else [])

    def stepped_tensor(self, fqn: str):
        """The shard or master the optimizer steps for ``fqn``, None where it steps the program's."""
        if fqn in self.shards:
            return self.shards[fqn]
        return self.masters.masters.get(fqn) if self.masters is not None else None

    def take_gradients(self, working) -> None:
        """After a backward: this rank's chunk of each summed gradient (ZeRO-1; ZeRO-2's are in
        the shards already) added into its shard's ``.grad``, the program's gradient dropped."""
        if self.masters is not None:
            self.masters.take_gradients(working)
        with torch.no_grad():
            for fqn, shard in self.shards.items():
                param = working(fqn)
                if param.grad is not None:
                    _add_grad(shard, self._chunk(param.grad, self._axes[fqn]))
                    param.grad = None

    def refresh(self, working, *, changed_only: bool = True) -> None:
        """All-gather every shard the optimizer changed since the last call (``changed_only=False``:
        every shard; fake tensors keep no versions) into the program's parameter (collective; then
        the remaining masters into theirs)."""
        with torch.no_grad():
            for fqn, shard in self.shards.items():
                if shard._version != self._gathered[fqn] or not changed_only:
                    param = working(fqn)
                    param.copy_(self._whole(shard.detach().to(param.dtype), fqn))
                    self._gathered[fqn] = shard._version
        if self.masters is not None:
            self.masters.refresh(working)

    def _whole(self, chunk: torch.Tensor, fqn: str) -> torch.Tensor:
        """The piece ``fqn``'s chunks (this rank's: ``chunk``, moved to the program's device from
        an offloaded shard's host) make, gathered over its ZeRO axes."""
        chunk = chunk.to(self._working(fqn).device)
        for a in reversed(self._axes[fqn]):
            chunk = all_gather(chunk, self._mesh.axis(a), 0)
        shape = self._shapes[fqn]
        return chunk[:math.prod(shape)].view(shape)

    def piece(self, fqn: str) -> torch.Tensor:
        """This rank's whole piece of ``fqn`` as the optimizer holds it (collective)."""
        return self._whole(self.shards[fqn].detach(), fqn)

    def state_piece(self, fqn: str, state: torch.Tensor) -> torch.Tensor:
        """The piece of ``fqn``'s storage that ``state``, a tensor shaped like its shard (an
        optimizer's moment), makes gathered over the ZeRO axes (collective)."""
        return self._whole(state.detach(), fqn)

    def state_chunk(self, fqn: str, piece: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``piece`` (shaped like ``fqn``'s storage piece), a fresh tensor on
        the shard's device: what :meth:`state_piece` gathered."""
        return self._chunk(piece.detach(), self._axes[fqn]).to(self.shards[fqn].device, copy=True)

    def load_piece(self, fqn: str, piece: torch.Tensor) -> None:
        """Set ``fqn``'s shard from its whole storage piece (a loaded checkpoint's); the next
        :meth:`refresh` gathers it into the program's parameter."""
        with torch.no_grad():
            self.shards[fqn].copy_(self._chunk(piece, self._axes[fqn]))

    def gradient_piece(self, fqn: str) -> torch.Tensor:
        """This rank's whole piece of ``fqn``'s gradient (zeros where none; collective)."""
        shard = self.shards[fqn]
        return self._whole(shard.grad if shard.grad is not None else torch.zeros_like(shard), fqn)

    def clip_entry(self, fqn: str, sharding) -> tuple:
        """``(shard, sharding, True)`` for :func:`~autopar.runtime.clip.clip_grad_norm_`: the
        ZeRO axes count as sharded (each rank holds distinct elements there)."""
        axes = self._axes[fqn]
        return self.shards[fqn], tuple(Shard(0) if a in axes else p for a, p in enumerate(sharding)), True


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    """``flat`` with zeros appended up to a multiple of ``n`` elements."""
    extra = -flat.numel() % n
    return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat


def _add_grad(shard: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``shard.grad`` (a fresh tensor of the shard's dtype when it has none:
    never a view that would keep a gradient bucket alive), moved in its own dtype to an
    offloaded shard's host and cast there."""
    moved = grad.to(shard.device)
    if shard.grad is None:
        shard.grad = moved.to(shard.dtype, copy=moved is grad)
    else:
        shard.grad.add_(moved.to(shard.dtype))


__all__ = ["ZeroShards", "check_level", "emitted_zero_axes", "stepped_piece"]
