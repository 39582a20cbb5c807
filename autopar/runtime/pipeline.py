"""PipelineProgram: a pipelined Plan run stage by stage over micro-batches.

Built once (anywhere), then used on every rank like a
:class:`~autopar.runtime.program.DistributedProgram`::

    program = PipelineProgram(captured, plan, model=model)      # compiled.program does this
    program.start(checkpoint=None)                              # as DistributedProgram.start
    opt = torch.optim.AdamW(program.parameters(), lr=1e-3)      # this rank's stage's shards
    loss = program.step(inputs)                                 # the batch's mean loss, 0-dim tensor
    program.clip_grad_norm_(1.0)                                # over every stage and shard
    program.optimizer_step(opt)                                 # opt.step(); fp16: loss scaling

Each rank runs one stage: the stage's graph (:mod:`autopar.plan.split`, cut from the
model captured at the micro-batch size) sharded on the stage's own ``(dp, tp)`` mesh by the
ordinary code generation. Stages may have different meshes, of different sizes. Boundary values
move point to point between neighbouring stages (:mod:`autopar.runtime.boundary`): on equal
meshes each rank sends its piece to the rank at the same coordinate of the next stage; on
different ones each receiver gathers its piece from the senders holding its rows
(:mod:`autopar.core.crossmesh`). ``step`` runs the plan's schedule, GPipe or 1F1B
(:mod:`autopar.runtime.schedule`), over the plan's micro-batches: each micro-batch's loss is
already its share of the whole batch's mean (see :class:`~autopar.plan.split.LossSplit`), so the
gradients add up to those of one process. Then a parameter that several stages hold (GPT-2's
embedding, tied to its head) gets the sum of their gradients, so every copy takes the same
update, and the loss is broadcast to every rank. A rank makes only its stage's pieces of the weights
(:mod:`autopar.runtime.weights`), as a DistributedProgram does.

Under a mixed-precision plan a stage runs in bf16 (its boundary pieces travel in bf16) and
``parameters()`` are fp32 masters (:mod:`autopar.runtime.mixed`); under ``"mixed-fp16"`` in fp16,
the last stage backpropagating each micro-batch's loss times the loss scale and
``optimizer_step(opt)`` skipping a step whose gradients overflowed on any stage
(:mod:`autopar.runtime.scaler`). On a stage the plan marks
``zero=1`` they are flat shards over the stage's data-parallel axis (:mod:`autopar.runtime.zero`):
the gradient each rank adds up over the micro-batches is reduce-scattered into them once per step,
and the updated shards are all-gathered before the next forward (a stage's ``zero=2`` would hold
and move the same, and is refused; ``zero=3`` is its parameters' sharded placements). A stage
the plan marks ``recompute`` runs each of its repeated layers under activation checkpointing
(:mod:`autopar.runtime.recompute`). A model whose buffers change in forward (BatchNorm) is not
pipelined.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from autopar.comm.buckets import deferred_gradient_sums, reset_pending
from autopar.comm.groups import resolve
from autopar.comm.mesh import RankMesh, default_device
from autopar.core.crossmesh import links
from autopar.core.errors import PipelineError
from autopar.core.layout import coord_of, local_piece
from autopar.core.options import SCHEDULES
from autopar.core.precision import named
from autopar.passes.codegen.split import generate_stage
from autopar.plan.split import count_program, loss_split, split_stages
from autopar.runtime import checkpoint as checkpoints
from autopar.runtime.boundary import Port
from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.graphio import pack, unpack
from autopar.runtime.host_allocator import return_freed_memory
from autopar.runtime.microbatch import stage_capture
from autopar.runtime.mixed import check_captured, program_values
from autopar.runtime.pipeline_stage import StageModule, stage_groups
from autopar.runtime.program import DistributedModule, flatten_inputs, gather_whole
from autopar.runtime.scaler import LossScale, LossScaler, loss_scaler, step_optimizer
from autopar.runtime.schedule import in_flight, order, run_schedule
from autopar.runtime.weights import ModelWeights, checkpoint_kind
from autopar.runtime.zero import ZeroShards, emitted_zero_axes, stepped_piece


@dataclasses.dataclass
class _Runtime:
    """One rank's built pieces (made by :meth:`PipelineProgram.module`)."""

    stage: object
    mesh: RankMesh
    module: StageModule
    upstream: Port | None  # from the previous stage (None on the first)
    downstream: Port | None  # to the next stage (None on the last)
    shared_groups: dict
    masters: object  # ZeroShards under the stage's ZeRO-1, else MasterWeights under mixed precision, else None
    scaler: LossScaler | None  # under fp16 mixed precision


class PipelineProgram:
    """A captured graph and a pipelined plan, run as a pipeline (module docstring).

    ``captured`` is the model's training capture at the plan's (whole) batch; ``model`` (on a
    real device or on meta) gives the weights unless :meth:`start` names a checkpoint, and is
    captured again at the micro-batch size; ``loss_fn`` as given to compile.
    """

    def __init__(self, captured, plan, *, model: nn.Module, loss_fn=None, device: torch.device | None = None):
        if not plan.stages:
            raise PipelineError("the plan has no pipeline stages: run it with DistributedProgram")
        for st in plan.stages:
            if st.zero == 2:
                raise PipelineError(f"stage {st.index} has zero=2, which a pipeline does not run: its gradients are"
                                    " summed once per step over the micro-batches, so ZeRO-2 would hold and move"
                                    " what ZeRO-1 does; use zero=1 (or 3)")
        self.plan = plan
        self.world_size = plan.num_devices
        self.mesh_shape = tuple(plan.mesh_shape)
        self.micro_batches = plan.micro_batches
        self.schedule = _checked_schedule(plan.schedule or "1f1b")
        self.precision = named(plan.precision)
        check_captured(captured, self.precision)
        if any(o.kind == "buffer_mutation" for o in captured.outputs):
            raise PipelineError("the model updates buffers in forward (e.g. BatchNorm running statistics),"
                                " which pipelined runs do not support: plan it without pipeline stages")
        self._device = device
        loss = self.loss_split = loss_split(captured, micro_batches=plan.micro_batches)  # how losses add up
        self._scale = 1.0 / plan.micro_batches if loss.kind == "mean" else 1.0
        small = stage_capture(model, captured, plan, loss_fn=loss_fn)
        frozen = {i.name for i in captured.inputs if i.kind == "parameter" and i.frozen}
        trainable_fqns = {fqn for fqn, p in model.named_parameters(remove_duplicate=False)
                          if p.requires_grad and fqn not in frozen}
        self._stages = split_stages(small, plan, loss=loss, trainable=trainable_fqns)
        self.links = links(plan.stages, self._stages)  # the blocks between stages (core.crossmesh)
        self._count = count_program(captured, loss.count) if loss.count is not None else None
        self._loss_dtype = self._stages[-1].graph_module.graph.output_node().args[0][0].meta["val"].dtype
        self._weights = ModelWeights([s for sg in self._stages for s in sg.stored], model=model,
                                     constants=getattr(captured.exported_program, "constants", {}) or {},
                                     tied=captured.tied, error=PipelineError)
        self._checkpoint = None
        holders: dict = {}
        for sg in self._stages:
            for s in sg.stored:
                if s.trainable:
                    holders.setdefault(s.fqn, []).append(sg.index)
        self._shared = {fqn: tuple(ks) for fqn, ks in sorted(holders.items()) if len(ks) > 1}
        user = [i for i in captured.inputs if i.kind == "user_input"]
        self._input_names = [i.name for i in user]
        nodes = [i.node for i in user]
        self._root = [nodes.index(b.name) for b in self._stages[0].inputs]
        in_spec = captured.exported_program.call_spec.in_spec
        self._kwarg_order = list(in_spec.child(1).context) if in_spec is not None else []
        self._tied = dict(captured.tied)
        self._emitted: dict[int, torch.fx.GraphModule] = {}
        self._packed: dict[int, dict] = {}
        self._runtime: _Runtime | None = None
        self._loss_scale: LossScale | None = None  # fp16's (start's), None: LossScale()'s defaults

    def with_schedule(self, schedule: str) -> "PipelineProgram":
        """The same stages and programs, run under ``schedule`` (``"gpipe"`` or ``"1f1b"``)."""
        other = PipelineProgram.__new__(PipelineProgram)
        other.__dict__.update(self.__dict__)  # (copy.copy would pickle: see __getstate__)
        other.schedule = _checked_schedule(schedule)
        other.plan = dataclasses.replace(self.plan, schedule=schedule)
        other._runtime = None
        return other

    # ------------------------------------------------------------------ emission

    def stage_of(self, rank: int):
        """``(StageGraph, position in its mesh)`` of global ``rank``."""
        for st, sg in zip(self.plan.stages, self._stages):
            if rank in st.ranks:
                return sg, st.ranks.index(rank)
        raise PipelineError(f"rank {rank} is in no stage of the plan")

    def emit(self, rank: int) -> torch.fx.GraphModule:
        """Rank ``rank``'s program (its stage's graph on its position of the stage mesh; cached)."""
        if rank not in self._emitted:
            if rank in self._packed:
                self._emitted[rank] = unpack(self._packed[rank])
            else:
                sg, position = self.stage_of(rank)
                if sg.graph_module is None:
                    raise PipelineError(f"rank {rank}'s program was not emitted before this copy was made")
                self._emitted[rank] = generate_stage(sg, rank=position, device=self._device)
        return self._emitted[rank]

    def code(self, rank: int = 0) -> str:
        """The Python source of rank ``rank``'s program (its stage's part of the model)."""
        return self.emit(rank).code

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_packed"] = {r: pack(self.emit(r)) for r in range(self.world_size)}
        state["_emitted"] = {}
        state["_stages"] = [dataclasses.replace(sg, graph_module=None) for sg in self._stages]
        state["_count"] = pack(self._count) if isinstance(self._count, torch.fx.GraphModule) else self._count
        state["_runtime"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if isinstance(self._count, dict):
            self._count = unpack(self._count)

    # ------------------------------------------------------------------ on a rank

    def module(self) -> StageModule:
        """This rank's stage module (built on first call; collective: makes process groups)."""
        return self._build().module

    def _build(self) -> _Runtime:
        if self._runtime is not None:
            return self._runtime
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            raise PipelineError(f"the plan needs torch.distributed initialised with {self.world_size} ranks:"
                                " launch it with torchrun (or autopar.testing.run_distributed)")
        device = self._device or default_device()
        return_freed_memory(device)
        stages = self.plan.stages
        axes, shared = stage_groups(stages, sorted(set(self._shared.values())))
        rank = dist.get_rank()
        sg, position = self.stage_of(rank)
        coord = coord_of(position, sg.mesh_shape)
        mesh = RankMesh(tuple(sg.mesh_shape), coord, axes[sg.index])
        pieces = self._weights.pieces(sg.stored, sg.mesh_shape, coord, device, self._checkpoint)
        pieces, masters = program_values(sg.stored, pieces, self.precision)
        inner = DistributedModule(self.emit(rank), mesh, sg.stored, [pieces[s.fqn] for s in sg.stored],
                                  recompute=stages[sg.index].recompute)
        module = StageModule(inner, sg, mesh, first=sg.index == 0, scale=self._scale)
        k = sg.index
        upstream = Port(self.links[k - 1], sg.inputs, rank=rank, device=device) if k > 0 else None
        downstream = Port(self.links[k], sg.outputs, rank=rank, device=device) if k < len(stages) - 1 else None
        scaler = loss_scaler(self.precision, self._loss_scale, device)
        self._runtime = _Runtime(sg, mesh, module, upstream, downstream, shared, masters, scaler)
        self._module_device = device
        if self._checkpoint is not None and checkpoint_kind(self._checkpoint) == "autopar":
            checkpoints.load(self, self._checkpoint)
        if stages[sg.index].zero == 1:
            self._runtime.masters = self.zero_shards(rank, inner, masters, mesh)
        return self._runtime

    def zero_shards(self, rank: int, inner: DistributedModule, masters, mesh: RankMesh) -> ZeroShards:
        """Rank ``rank``'s :class:`ZeroShards` of its stage's ZeRO-1 (``inner``: its stage's module,
        taking over ``masters``): the gradient each rank adds up over the micro-batches is
        reduce-scattered once per step into the shards. A parameter several stages hold keeps
        whole optimizer state (its stages add their gradients whole)."""
        sg, _ = self.stage_of(rank)
        placeholders = self.emit(rank).graph.find_nodes(op="placeholder")[len(sg.inputs):]
        names = {n.name: s.fqn for n, s in zip(placeholders, sg.stored)
                 if s.trainable and s.kind == "parameter" and s.fqn not in self._shared}
        axes = emitted_zero_axes(self.emit(rank), names)
        return ZeroShards(axes, inner.stored, masters, mesh, 1, inner._grad_hooks, scatter=True)

    @property
    def shards_optimizer(self) -> bool:
        """Whether this rank's optimizer steps ZeRO shards (a started stage with ``zero == 1``)."""
        return self.optimizer_shards is not None

    @property
    def optimizer_shards(self) -> ZeroShards | None:
        """The ZeRO shards this rank's optimizer steps (a started stage with ``zero == 1``), else None."""
        masters = self._runtime.masters if self._runtime is not None else None
        return masters if isinstance(masters, ZeroShards) else None

    def start(self, checkpoint=None, *, loss_scale: LossScale | None = None) -> PipelineProgram:
        """Build this rank's stage (collective) from ``checkpoint`` (a Hugging Face folder, an
        autopar checkpoint directory, or None: the model) with fp16's ``loss_scale``, as
        :meth:`DistributedProgram.start`."""
        if checkpoint is not None:
            checkpoint_kind(checkpoint)  # fails early on anything else
        self._checkpoint = checkpoint
        self._loss_scale = loss_scale
        self.reset()
        self._build()
        return self

    def reset(self) -> None:
        """Forget this rank's module: the next use starts again from the model's tensors or the
        checkpoint :meth:`start` named."""
        self._runtime = None

    def parameters(self):
        """This rank's local parameter shards (its stage's), for the user's optimizer (fp32 masters
        under mixed precision; under ZeRO-1 flat shards of those summed over the stage's ``dp``)."""
        rt = self._build()
        if rt.masters is None:
            return rt.module.parameters()
        parameters = [s.fqn for s in rt.stage.stored if s.kind == "parameter"]
        return iter(rt.masters.stepped(rt.module.module.stored, parameters))

    def _parameter(self, rt: _Runtime, fqn: str) -> torch.Tensor:
        """What the optimizer steps for stored tensor ``fqn`` as a piece of the storage sharding: its
        master, its ZeRO shards gathered (collective), else the tensor itself."""
        return stepped_piece(rt.masters, fqn, rt.module.module.stored)

    def stored_tensors(self) -> list[tuple[str, str, tuple, torch.Tensor]]:
        """``(FQN, "parameter" | "buffer", storage sharding, local tensor)`` of every parameter
        and buffer this rank's stage stores (collective on first call)."""
        rt = self._build()
        return [(s.fqn, s.kind, tuple(s.sharding), self._parameter(rt, s.fqn))
                for s in rt.stage.stored if s.kind in ("parameter", "buffer")]

    @property
    def copies(self) -> frozenset:
        """FQNs of the parameters this rank's stage holds that an earlier stage holds too (a
        checkpoint saves them from the first holder only)."""
        here = self._build().stage.index
        return frozenset(fqn for fqn, holders in self._shared.items() if here in holders and holders[0] != here)

    def storage_mesh(self) -> tuple[RankMesh, tuple[int, ...]]:
        """This rank's stage mesh and the stage's global ranks, row-major."""
        rt = self._build()
        return rt.mesh, tuple(self.plan.stages[rt.stage.index].ranks)

    def step(self, inputs, target=None) -> torch.Tensor:
        """Forward and backward of a global batch through the pipeline, micro-batch by
        micro-batch; returns the batch's loss on every rank as a detached 0-dim tensor (no host
        sync). Gradients are in ``parameters()`` and add up over several steps (accumulation);
        scaled under fp16 mixed precision, as :meth:`DistributedProgram.step` leaves them."""
        rt = self._build()
        reset_pending()
        flat = flatten_inputs(inputs, target, kwarg_order=self._kwarg_order, names=self._input_names)
        for x, name in zip(flat, self._input_names):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % self.micro_batches:
                raise PipelineError(f"input {name!r} must be a tensor whose first (batch) dim divides into"
                                    f" {self.micro_batches} micro-batches")
        device = self._module_device
        if rt.scaler is not None:
            rt.scaler.check_backward(rt.masters.owned())
        if rt.masters is not None:
            rt.masters.refresh(rt.module.module.stored)
        first, last = rt.stage.index == 0, not rt.stage.outputs
        if last and self._count is not None:
            with torch.no_grad():
                rt.module.count = self._count(*flat).to(device)
        feeds = None
        if first:
            args = [flat[i].to(device, b.dtype if self.precision.master else None)  # the bf16 copy's inputs
                    for i, b in zip(self._root, rt.stage.inputs)]
            feeds = list(zip(*(x.tensor_split(self.micro_batches) for x in args)))
        k, count = rt.stage.index, len(self.plan.stages)
        steps = list(order(self.micro_batches, in_flight(self.schedule, k, count, self.micro_batches)))
        before = self._take_shared_gradients(rt)
        with deferred_gradient_sums():  # data-parallel sums once per step, not per micro-batch
            losses = run_schedule(rt.module, rt.stage, steps, micro_batches=self.micro_batches, feeds=feeds,
                                  upstream=rt.upstream, downstream=rt.downstream,
                                  loss_gradient=rt.scaler.loss_gradient if rt.scaler is not None else None)
        self._sum_shared_gradients(rt, before)
        if rt.masters is not None:
            rt.masters.take_gradients(rt.module.module.stored)
        if rt.scaler is not None:
            rt.scaler.took_gradients(rt.masters.owned())
        total = torch.zeros((), dtype=torch.float64, device=device)
        if last:
            total = torch.stack([x.detach() for x in losses]).to(torch.float64).sum()
        dist.broadcast(total, src=self.plan.stages[-1].ranks[0])
        return total.to(self._loss_dtype)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient of every stage so that their total norm is at most ``max_norm``
        (a parameter several stages hold counted once); returns the norm before scaling
        (collective; as ``torch.nn.utils.clip_grad_norm_`` on the whole model in one process)."""
        rt = self._build()
        self.unscale_()
        here = rt.stage.index
        zero = rt.masters if isinstance(rt.masters, ZeroShards) else None
        entries = [zero.clip_entry(s.fqn, s.sharding) if zero is not None and s.fqn in zero.shards
                   else (self._parameter(rt, s.fqn), s.sharding, self._shared.get(s.fqn, (here,))[0] == here)
                   for s in rt.stage.stored if s.trainable]
        return clip_grad_norm_(entries, max_norm, norm_type, mesh=rt.mesh)

    def unscale_(self) -> None:
        """As :meth:`DistributedProgram.unscale_`, over every stage (collective)."""
        rt = self._build()
        if rt.scaler is not None:
            rt.scaler.unscale_(rt.masters.owned())

    def optimizer_step(self, optimizer) -> bool:
        """As :meth:`DistributedProgram.optimizer_step`: ``optimizer.step()``, under fp16 mixed
        precision unless a gradient on some stage overflowed; returns whether it stepped."""
        rt = self._build()
        return step_optimizer(rt.scaler, optimizer, rt.masters)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """As :attr:`DistributedProgram.loss_scaler`, of this rank's started stage."""
        return self._runtime.scaler if self._runtime is not None else None

    def _take_shared_gradients(self, rt: _Runtime) -> dict:
        """The gradients so far of the parameters this stage shares with others, taken off them:
        a step sums over stages only what it adds (gradient accumulation)."""
        before = {}
        for fqn, holders in self._shared.items():
            if rt.stage.index in holders:
                param = rt.module.module.stored(fqn)
                before[fqn], param.grad = param.grad, None
        return before

    def _sum_shared_gradients(self, rt: _Runtime, before: dict) -> None:
        """A parameter held by several stages gets the sum of their gradients (Megatron's
        embedding group), added to its gradient ``before`` the step: every copy then takes the
        same optimizer step. Stages of one mesh storing it alike add their pieces position by
        position; otherwise each stage's first rank adds its whole gradient and every rank keeps
        its piece of the sum."""
        for fqn, holders in self._shared.items():
            if rt.stage.index not in holders:
                continue
            param = rt.module.module.stored(fqn)
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            group = resolve(rt.shared_groups[holders])
            layouts = {(tuple(self._stages[k].mesh_shape), self._sharding_of(k, fqn)) for k in holders}
            widths = {len(self.plan.stages[k].ranks) for k in holders}
            with torch.no_grad():
                if len(layouts) == 1:
                    grad = grad.clone()
                    dist.all_reduce(grad, group=group)
                else:  # stored differently: add whole gradients, keep this rank's piece
                    mine = self._sharding_of(rt.stage.index, fqn)
                    whole = gather_whole({fqn: grad}, {fqn: mine}, rt.mesh)[fqn].to(grad.device)
                    if len(widths) > 1 and any(rt.mesh.coord):  # one group of every holder's ranks
                        whole.zero_()
                    dist.all_reduce(whole, group=group)
                    grad = local_piece(whole, mine, rt.mesh.mesh_shape, rt.mesh.coord).contiguous()
            param.grad = grad if before[fqn] is None else before[fqn].add_(grad)

    def _sharding_of(self, k: int, fqn: str) -> tuple:
        return next(s.sharding for s in self._stages[k].stored if s.fqn == fqn)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered whole on every rank (collective), tied aliases
        pointing at the same tensor; PipelineError if the stages' copies of a shared parameter
        differ."""
        rt = self._build()
        stored = [s for s in rt.stage.stored if s.kind != "constant"]
        local = {s.fqn: self._parameter(rt, s.fqn) for s in stored}
        whole = gather_whole(local, {s.fqn: s.sharding for s in stored}, rt.mesh)
        mine = whole if not any(rt.mesh.coord) else {}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        out: dict = {}
        for part in everyone:
            for fqn, t in part.items():
                if fqn in out and not torch.equal(out[fqn], t):
                    raise PipelineError(f"the stages' copies of {fqn} differ: their gradients were not"
                                        " summed before the optimizer step (call step() for every batch)")
                out.setdefault(fqn, t)
        for alias, canon in self._tied.items():
            if canon in out:
                out[alias] = out[canon]
        return out


def _checked_schedule(schedule: str) -> str:
    """``schedule``, checked (1F1B with fewer micro-batches than stages holds them all on the
    first stages, as GPipe does)."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return schedule


__all__ = ["PipelineProgram"]
