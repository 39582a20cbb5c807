"""One rank's emitted program run for one training step on fake tensors, under a fake process
group of the plan's world size: no data, no real memory, any size.

The world is ``torch.distributed``'s ``"fake"`` backend (every collective returns at once with
the right shapes); the rank's mesh is made before :class:`FakeTensorMode` is entered (making
groups reads values). Every stored tensor is a fake of its local shard's shape, made from the
model's shapes alone, so a model built on ``device="meta"`` is never materialised. The step is
forward, backward and the optimizer's step (:func:`make_optimizer`), with the
:class:`~autopar.runtime.verify.memory.MemoryTracker`, the collectives' log and torch's
``FlopCounterMode`` watching.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autopar.comm.record import listening
from autopar.core.errors import AutoparError
from autopar.core.placement import local_shape
from autopar.cost_models.compute import flop_formulas
from autopar.runtime.mixed import program_values
from autopar.runtime.verify.memory import MemoryTracker

CPU = torch.device("cpu")
# where an offloaded optimizer's tensors live in a fake step: a device of their own, so that the
# tracker tells the host's bytes from the device's (fake tensors on both are CPU's otherwise)
FAKE_HOST = torch.device("meta")


class VerifyError(AutoparError, RuntimeError):
    """A plan's program cannot be verified here."""


@dataclass
class CollectiveLog:
    """The collectives one rank issued: ``(kind, mesh axis, bytes, phase)`` each, from
    :mod:`autopar.comm.record` (``axes``: process-group name -> mesh axis); ``buckets`` counts
    the gradient buckets that carried the reported sums."""

    axes: dict
    phase: str = "forward"
    issued: list = field(default_factory=list)
    buckets: int = 0

    def begin(self, kind, group, nbytes) -> None:
        if kind == "bucket":
            self.buckets += 1
            return
        name = getattr(group, "group_name", None)
        if name not in self.axes:
            raise VerifyError(f"a {kind} ran on process group {name!r}, which is no mesh axis of this rank")
        self.issued.append((kind, self.axes[name], nbytes, self.phase))

    def end(self, output) -> None:
        return None


class _Both:
    """Hands each collective to the memory tracker and to the log."""

    def __init__(self, *listeners):
        self.listeners = listeners

    def begin(self, kind, group, nbytes) -> None:
        for x in self.listeners:
            x.begin(kind, group, nbytes)

    def end(self, output) -> None:
        for x in self.listeners:
            x.end(output)


@dataclass
class Watch:
    """What watched one rank's step: memory, collectives, FLOPs."""

    memory: MemoryTracker
    log: CollectiveLog
    flops: FlopCounterMode

    def set_phase(self, phase: str) -> None:
        if phase == "backward":
            self.memory.end_forward()
        self.memory.phase = self.log.phase = phase


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """A fake default process group of ``world_size`` ranks in which this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise VerifyError("verify makes its own fake process group of the plan's size: call it outside a"
                          " torch.distributed job (before init_process_group, or after destroy_process_group)")
    hook = sys.excepthook  # init_process_group wraps it, to prefix tracebacks with the rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_shard(shape, dtype: torch.dtype, sharding, mesh_shape) -> torch.Tensor:
    """A fake tensor of the local shape of a ``shape`` tensor under ``sharding`` (call inside a
    FakeTensorMode)."""
    return torch.empty(local_shape(tuple(shape), sharding, tuple(mesh_shape)), dtype=dtype, device=CPU)


def make_optimizer(params, name: str):
    """The plan's optimizer as torch implements it on a GPU (``foreach``), in its steady state
    (its state made by an earlier step, as from the second step of training on): ``"adam"`` is
    AdamW (two moments of the parameters' dtype), ``"sgd"`` SGD without momentum (no state)."""
    params = [p for p in params if p.requires_grad]
    if name == "adam":
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
    else:
        raise VerifyError(f"verify knows the optimizers 'adam' and 'sgd', not {name!r}")
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def fake_stored(stored, weights, mesh_shape, precision) -> list[torch.Tensor]:
    """Fake local shards of the ``stored`` tensors, made from their shapes alone (``weights``: the
    program's :class:`~autopar.runtime.weights.ModelWeights`; nothing is materialised) in
    ``precision``'s dtypes (call inside a FakeTensorMode)."""
    out = []
    for s in stored:
        shape, dtype = weights.global_meta[s.fqn]
        out.append(fake_shard(shape, precision.dtype(dtype), s.sharding, mesh_shape))
    return out


def fake_program_values(stored, weights, mesh_shape, precision, *, host=None, parameters: bool = False):
    """``(values, masters)``: :func:`fake_stored`'s shards in :attr:`DistributedModule`'s order and,
    under mixed precision or offloaded to ``host``, fake masters of the parameters
    (:func:`~autopar.runtime.mixed.program_values`; None otherwise; ``parameters``: the parameters
    on ``host`` too)."""
    values, masters = program_values(stored, dict(zip((s.fqn for s in stored),
                                                       fake_stored(stored, weights, mesh_shape, precision))), precision,
                                     host=host, parameters=parameters)
    return [values[s.fqn] for s in stored], masters


def stepped(module, masters) -> list[torch.Tensor]:
    """The tensors the optimizer steps: ``masters``' (mixed precision's masters, ZeRO's shards),
    else the module's parameters."""
    if masters is None:
        return list(module.parameters())
    return masters.stepped(module.stored, [fqn for fqn, _ in module.named_parameters()])


aten = torch.ops.aten
# torch's FlopCounterMode counts the GPU attention kernels but not the one CPU tensors (fake ones
# included) dispatch to: the same GEMMs, by torch's own attention formulas
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v)),
}


class _NoModules:
    """A stand-in for FlopCounterMode's module tracker: verify reads the total only, and torch's
    tracker keeps every gradient of a module's inputs (a multi-grad hook on them) until the last one
    arrives, so the parameters' gradients would stay twice (the hook's and the accumulated copy)
    until the end of backward: memory the program does not hold."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode counting the whole step only (:class:`_NoModules`)."""
    counter = FlopCounterMode(display=False, custom_mapping={**CPU_ATTENTION_FLOPS, **flop_formulas()})
    counter.mod_tracker = _NoModules()
    return counter


@contextlib.contextmanager
def watching(axes: dict, opt, tracked=(), inputs=(), host=None):
    """Watch one step (:class:`Watch`); ``tracked`` (parameters, buffers), ``opt``'s state and
    ``inputs`` existed before it; tensors on ``host`` are counted apart (an offloaded optimizer's)."""
    memory, log = MemoryTracker(host), CollectiveLog(axes)
    for t in list(tracked) + optimizer_state(opt):
        memory.track(t, "setup")
    for t in inputs:
        memory.track(t, "input")
    counter = flop_counter()
    with memory, counter as flops, listening(_Both(memory, log)):
        yield Watch(memory, log, flops)


def optimizer_state(opt) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def bytes_of(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


__all__ = ["CPU", "FAKE_HOST", "CollectiveLog", "VerifyError", "Watch", "fake_mode", "fake_program_values",
           "fake_shard", "fake_stored",
           "fake_world", "make_optimizer", "optimizer_state", "stepped", "watching"]
