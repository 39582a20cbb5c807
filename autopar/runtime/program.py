"""DistributedProgram: a captured graph + a sharding assignment, run on torch.distributed.

Built once (anywhere: it needs no process group), then used on every rank::

    program = DistributedProgram(captured, assignment, model=model)   # model may be on meta
    print(program.code(rank=0))                 # the emitted program of rank 0
    # on each rank, after torch.distributed.init_process_group(...):
    program.start(checkpoint=None)              # or a Hugging Face folder / autopar checkpoint
    opt = torch.optim.AdamW(program.parameters(), lr=1e-3)
    for batch in data:
        opt.zero_grad()
        loss = program.step(batch)              # global batch in; forward + backward; 0-dim tensor
        program.clip_grad_norm_(1.0)            # over every shard, as torch's on one process
        program.optimizer_step(opt)             # opt.step(); under fp16 loss scaling (see below)
    full = program.full_state_dict()            # collective: gathers every shard

Each rank holds only its piece of every parameter (by the placeholder's storage sharding) as an
``nn.Parameter``; a tied weight is one parameter. The pieces are made when the module is first
needed, never as a whole model (:mod:`autopar.runtime.weights`): cut from a real model's tensors,
initialised one tensor at a time for a model on ``device="meta"``, or read from a checkpoint.
Building a program materialises nothing. Under a mixed-precision plan (``precision="mixed"``)
the program runs in bf16 and ``parameters()`` are fp32 masters (:mod:`autopar.runtime.mixed`);
under ``"mixed-fp16"`` it runs in fp16 and scales the loss (:mod:`autopar.runtime.scaler`):
``optimizer_step(opt)`` then skips a step whose gradients overflowed.
Under ZeRO-1/2 (``zero=1|2``) ``parameters()`` are this rank's flat shards of the parameters
summed over data-parallel axes (:mod:`autopar.runtime.zero`).
The program pickles (emitted graphs travel as plain data, see :mod:`autopar.runtime.graphio`), so
``autopar.testing.run_distributed`` can hand it to spawned workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.comm.buckets import reset_pending, wait_outputs
from autopar.comm.collectives import autopar_all_gather, autopar_grad_all_reduce, use_mesh
from autopar.comm.mesh import RankMesh, default_device, rank_mesh
from autopar.comm.plain import all_gather
from autopar.comm.regather import keep_sharded
from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import CodegenError
from autopar.core.ir import is_tensor_node
from autopar.core.layout import piece_cuts
from autopar.core.placement import R, Shard, format_sharding
from autopar.core.precision import named
from autopar.passes.codegen import CodegenContext, generate
from autopar.plan.stored import Stored
from autopar.runtime import checkpoint as checkpoints
from autopar.runtime.clip import clip_grad_norm_
from autopar.runtime.fetch import Fetcher, fetch_parameters
from autopar.runtime.host_allocator import return_freed_memory
from autopar.runtime.graphio import pack, unpack
from autopar.runtime.mixed import HOST, check_captured, program_values
from autopar.runtime.recompute import CheckpointHost, recompute_layers
from autopar.runtime.scaler import LossScale, loss_scaler, step_optimizer
from autopar.runtime.weights import ModelWeights, checkpoint_kind
from autopar.runtime.zero import ZeroShards, check_level, emitted_zero_axes, stepped_piece


@dataclass(frozen=True)
class _UserInput:
    node: str
    name: str
    sharding: tuple


def _behind_gradient_sums(node: torch.fx.Node) -> torch.fx.Node:
    """What ``node`` reads through gradient sums (identities in forward, which hand a running
    module's parameter on as itself): HSDP's all-gather after a data-parallel gradient sum still
    gathers the parameter."""
    while node.op == "call_function" and node.target is autopar_grad_all_reduce:
        node = node.args[0]
    return node


class DistributedModule(nn.Module):
    """One rank's module: local parameter shards, and the emitted program as ``program``.

    ``forward(*local_inputs)`` returns the graph's outputs (local pieces, per the assignment's
    output shardings). With ``recompute`` (True or "selective") its repeated layers recompute their
    forward in backward (:mod:`autopar.runtime.recompute`). ``fetch``: ``(device, placeholder
    names, tiles)``, parameters whose values are on the host and are fetched to ``device`` layer by
    layer (:mod:`autopar.runtime.fetch`), and the nodes run tile by tile (node name -> tiles).
    ``checkpoints``: the device the recomputed layers' checkpoints wait on between forward and
    backward (the host; :class:`~autopar.runtime.recompute.CheckpointHost`).
    """

    def __init__(self, program: torch.fx.GraphModule, mesh: RankMesh, stored, values, mutations=(), *,
                 recompute: bool | str = False, fetch: tuple | None = None,
                 checkpoints: torch.device | None = None):
        super().__init__()
        self._checkpoints = CheckpointHost(checkpoints) if checkpoints is not None else None
        self._fetcher = None
        if fetch is not None:
            self._fetcher = Fetcher(fetch[0])
            program = fetch_parameters(program, fetch[1], self._fetcher, fetch[2])
        self._mesh = mesh
        self._mutations = list(mutations)  # (output index, buffer FQN) updated after each run
        self._grad_hooks: dict = {}  # parameters whose gradient sums are hooked (collectives)
        self._gathers_parameters = any(  # ZeRO-3/FSDP: gathered again in backward, not kept
            n.target is autopar_all_gather and _behind_gradient_sums(n.args[0]).op == "placeholder"
            for n in program.graph.nodes)
        self.program = recompute_layers(program, mesh, self._grad_hooks, selective=recompute == "selective",
                                        host=self._checkpoints) if recompute else program
        for s, value in zip(stored, values):
            owner, leaf = self._owner(s.fqn)
            if s.kind == "parameter":
                owner.register_parameter(leaf, nn.Parameter(value, requires_grad=s.trainable))
            else:
                owner.register_buffer(leaf, value)

    def _owner(self, fqn: str):
        *path, leaf = fqn.split(".")
        module = self
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        return module, leaf

    def stored(self, fqn: str) -> torch.Tensor:
        module, leaf = self._owner(fqn)
        return getattr(module, leaf)

    def forward(self, *placeholder_values, wait: bool = True):
        """The program's outputs; ``wait=False`` leaves output all-reduces in flight (call
        :func:`autopar.comm.buckets.wait_outputs` before reading those outputs)."""
        if self._fetcher is not None:
            self._fetcher.clear()
        with use_mesh(self._mesh, self._grad_hooks), \
                keep_sharded() if self._gathers_parameters or self._fetcher is not None else contextlib.nullcontext():
            out = self.program(*placeholder_values)
        if self._checkpoints is not None:
            self._checkpoints.clear()  # the checkpoints now hold their host copies alone
        if wait:
            wait_outputs()
            self.apply_mutations(out)
        return out

    def apply_mutations(self, outputs) -> None:
        """Copy the program's new buffer values (BatchNorm running statistics) into the buffers."""
        if not self._mutations:
            return
        with torch.no_grad():
            for index, fqn in self._mutations:
                self.stored(fqn).copy_(outputs[index])


class DistributedProgram:
    """A captured graph and a :class:`ShardingAssignment`, emitted per rank and run on
    torch.distributed (see the module docstring).

    ``captured`` is a :class:`~autopar.passes.capture.CapturedGraph`; the tensors come from
    ``model`` (its parameters, buffers and ``requires_grad`` flags; on a real device or on meta)
    or a ``state_dict`` keyed by the same FQNs, unless :meth:`start` names a checkpoint.
    ``precision``: the plan's (a name of :data:`~autopar.core.precision.PRECISIONS`); ``"mixed"``
    needs ``captured`` made with ``mixed_precision=True``. ``zero``: the ZeRO stage of the
    parameters it keeps whole on data-parallel axes (0, 1 or 2; :mod:`autopar.runtime.zero`).
    ``recompute``: its repeated layers recompute their forward in backward, True or "selective"
    (``Plan.recompute``).
    ``offload``: the optimizer's masters live on ``host`` and it steps them there (``Plan.offload``,
    :mod:`autopar.runtime.mixed`); ``offload_parameters``: the parameters too, fetched to the
    device layer by layer (``Plan.offload_parameters``, :mod:`autopar.runtime.fetch`; ZeRO 0 only),
    and ``tiles`` (node name -> tiles) of their linears and embeddings run tile by tile
    (``Plan.tiles``, :mod:`autopar.runtime.tiles`). ``offload_activations``: the recomputed layers'
    checkpoints wait on ``host`` between forward and backward (``Plan.offload_activations``).
    """

    def __init__(self, captured, assignment: ShardingAssignment, *, model: nn.Module | None = None,
                 state_dict=None, device: torch.device | None = None, precision: str = "fp32", zero: int = 0,
                 recompute: bool | str = False, offload: bool = False, host: torch.device = HOST,
                 offload_parameters: bool = False, tiles: dict | None = None, offload_activations: bool = False):
        if not isinstance(assignment, ShardingAssignment):
            raise CodegenError(f"assignment must be a ShardingAssignment, got {type(assignment).__name__}")
        if (model is None) == (state_dict is None):
            raise CodegenError("pass exactly one of model= or state_dict= (where the weights come from)")
        self.assignment = assignment
        self.mesh_shape = assignment.mesh_shape
        self._device = device
        self.precision = named(precision)
        self.zero = check_level(zero)
        self.recompute = recompute
        self.host = host if offload or offload_parameters else None
        self.offload_parameters = offload_parameters
        self.tiles = dict(tiles or {})
        self.checkpoint_host = host if offload_activations else None
        if offload_activations and recompute is not True:
            raise CodegenError("offloaded checkpoints are a recomputing program's (recompute=True)")
        if self.tiles and not offload_parameters:
            raise CodegenError("layers run tile by tile fetch their tiles from the host: tiles need offload_parameters")
        if offload_parameters and self.zero:
            raise CodegenError(f"parameters fetched from the host run at ZeRO 0 (their optimizer steps on the host"
                               f" already), not ZeRO-{self.zero}: plan with zero=0")
        check_captured(captured, self.precision)
        self._stored: list[Stored] = []
        self._inputs: list[_UserInput] = []
        self._placeholders: list = []  # ("stored", i) or ("input", i), in placeholder order
        for inp in captured.inputs:
            sh = assignment.placeholder_shardings.get(inp.node, (R,) * len(self.mesh_shape))
            if inp.kind == "user_input":
                self._placeholders.append(("input", len(self._inputs)))
                self._inputs.append(_UserInput(inp.node, inp.name, sh))
                continue
            if inp.kind not in ("parameter", "buffer", "constant"):
                raise CodegenError(f"graph input {inp.node} is a {inp.kind}, which the runtime cannot feed")
            self._placeholders.append(("stored", len(self._stored)))
            self._stored.append(Stored(inp.node, inp.kind, inp.name, sh, inp.kind == "parameter" and not inp.frozen))
        self._weights = ModelWeights(self._stored, model=model, state_dict=state_dict, tied=captured.tied,
                                     constants=getattr(captured.exported_program, "constants", {}) or {})
        trainable = self._weights.trainable
        self._stored = [dataclasses.replace(s, trainable=s.trainable and trainable.get(s.fqn, True))
                        for s in self._stored]
        self._checkpoint = None
        self._tied = dict(captured.tied)
        self._loss_index, self._mutations = None, []
        for index, out in _tensor_outputs(captured):
            if out.kind == "loss" and self._loss_index is None:
                self._loss_index = index
            elif out.kind == "buffer_mutation":
                self._mutations.append((index, out.name))
            elif out.kind not in ("user_output", "loss"):
                raise CodegenError(f"the graph returns a {out.kind} ({out.name!r}), which the"
                                   " runtime cannot apply; write the model without it")
        assignment = self.assignment = _store_mutations(assignment, self._mutations, self._stored)
        in_spec = captured.exported_program.call_spec.in_spec
        self._kwarg_order = list(in_spec.child(1).context) if in_spec is not None else []
        self._graph = captured.graph_module
        self._trainable = frozenset(s.node for s in self._stored if s.trainable)
        self._emitted: dict[int, torch.fx.GraphModule] = {}
        self._packed: dict[int, dict] = {}
        self._module: DistributedModule | None = None
        self._masters = None  # MasterWeights (mixed precision) or ZeroShards (zero > 0), made with the module
        self._loss_scale: LossScale | None = None  # fp16's (start's), None: LossScale()'s defaults
        self._scaler = None  # its LossScaler under fp16 mixed precision, made with the module
        self._input_cuts: dict = {}

    # ------------------------------------------------------------------ emission

    def emit(self, rank: int) -> torch.fx.GraphModule:
        """Rank ``rank``'s program (a GraphModule; cached)."""
        if rank not in self._emitted:
            if rank in self._packed:
                self._emitted[rank] = unpack(self._packed[rank])
            elif self._graph is None:
                raise CodegenError(f"rank {rank}'s program was not emitted before this copy was made")
            else:
                ctx = CodegenContext(assignment=self.assignment, rank=rank, trainable=self._trainable,
                                     loss_outputs=() if self._loss_index is None else (self._loss_index,),
                                     device=self._device)
                self._emitted[rank] = generate(self._graph, ctx)
        return self._emitted[rank]

    def code(self, rank: int = 0) -> str:
        """The Python source of rank ``rank``'s program."""
        return self.emit(rank).code

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_packed"] = {r: pack(self.emit(r)) for r in range(self.assignment.world_size)}
        state["_emitted"] = {}
        state["_graph"] = None
        state["_module"] = None
        state.pop("_mesh", None)
        state.pop("_where", None)
        return state

    # ------------------------------------------------------------------ on a rank

    def start(self, checkpoint=None, *, loss_scale: LossScale | None = None) -> DistributedProgram:
        """Build this rank's module (collective) from ``checkpoint``: a Hugging Face folder
        (``save_pretrained``), an autopar checkpoint directory, or None for the model (its
        tensors, or its initialisers for a model on meta). Later rebuilds (:meth:`reset`) start
        from the same place. ``loss_scale``: how fp16 mixed precision scales the loss (default
        ``LossScale()``; other precisions do not scale). Returns the program."""
        if checkpoint is not None:
            checkpoint_kind(checkpoint)  # fails early on anything else
        self._checkpoint = checkpoint
        self._loss_scale = loss_scale
        self.reset()
        self.module()
        return self

    def module(self) -> DistributedModule:
        """This rank's :class:`DistributedModule` (built on first call; collective)."""
        if self._module is None:
            device = self._device or default_device()
            return_freed_memory(device)
            mesh = self._mesh = getattr(self, "_mesh", None) or rank_mesh(self.mesh_shape)
            pieces = self._weights.pieces(self._stored, self.mesh_shape, mesh.coord, device, self._checkpoint)
            pieces, self._masters = program_values(self._stored, pieces, self.precision, host=self.host,
                                                   parameters=self.offload_parameters)
            values = [pieces[s.fqn] for s in self._stored]
            if self.offload_parameters and torch.device(device).type == "cuda":  # asynchronous copies need pinned pages
                values = [v.pin_memory() if v.device.type == "cpu" and v.is_floating_point() else v for v in values]
            gm = self.emit(dist.get_rank())
            self._module = DistributedModule(gm, mesh, self._stored, values, self._mutations,
                                             recompute=self.recompute, fetch=self.fetched(gm, values, device),
                                             checkpoints=self.checkpoint_host)
            # per placeholder: (owning submodule, attribute) of a stored tensor, None for an input
            self._where = [self._module._owner(self._stored[i].fqn) if kind == "stored" else None
                           for kind, i in self._placeholders]
            self._module_device = device
            if self._checkpoint is not None and checkpoint_kind(self._checkpoint) == "autopar":
                checkpoints.load(self, self._checkpoint)
            if self.zero:
                self._masters = self.zero_shards(self._module, self._masters, mesh)
            self._scaler = loss_scaler(self.precision, self._loss_scale, device)
        return self._module

    def fetched(self, gm: torch.fx.GraphModule, values, device) -> tuple | None:
        """``DistributedModule``'s ``fetch`` for the program ``gm`` on ``values`` (the stored
        tensors'): ``(device, names of the floating parameters' placeholders, tiles)``, None unless
        the parameters are offloaded."""
        if not self.offload_parameters:
            return None
        names = {n.name for n, (kind, i) in zip(gm.graph.find_nodes(op="placeholder"), self._placeholders)
                 if kind == "stored" and self._stored[i].kind == "parameter" and values[i].is_floating_point()}
        return device, names, self.tiles

    def zero_shards(self, module: DistributedModule, masters, mesh: RankMesh) -> ZeroShards:
        """``module``'s :class:`ZeroShards` at this program's ZeRO stage, taking over ``masters``."""
        return ZeroShards(self.zero_axes(dist.get_rank()), module.stored, masters, mesh, self.zero, module._grad_hooks)

    def zero_axes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """FQN -> the mesh axes rank ``rank``'s program sums that trainable parameter's gradient
        over as data parallelism does: where ZeRO-1/2 shard it (:func:`autopar.runtime.zero.emitted_zero_axes`)."""
        gm = self.emit(rank)
        names = {n.name: self._stored[i].fqn for n, (kind, i) in zip(gm.graph.find_nodes(op="placeholder"),
                                                                      self._placeholders)
                 if kind == "stored" and self._stored[i].trainable and self._stored[i].kind == "parameter"}
        return emitted_zero_axes(gm, names)

    @property
    def offload(self) -> bool:
        """Whether the optimizer steps on the host (``Plan.offload``)."""
        return self.host is not None

    @property
    def shards_optimizer(self) -> bool:
        """Whether this rank's optimizer steps ZeRO shards (a started program with ``zero > 0``)."""
        return self.optimizer_shards is not None

    @property
    def optimizer_shards(self) -> ZeroShards | None:
        """The ZeRO shards this rank's optimizer steps (a started program with ``zero > 0``), else None."""
        return self._masters if isinstance(self._masters, ZeroShards) and self._module is not None else None

    def reset(self) -> None:
        """Forget this rank's module: the next :meth:`module` starts again from the model's
        tensors or the checkpoint :meth:`start` named (the process groups are kept)."""
        self._module = None

    def storage_mesh(self) -> tuple[RankMesh, tuple[int, ...]]:
        """The mesh this rank's stored tensors are sharded over and its global ranks, row-major."""
        return self.module()._mesh, tuple(range(self.assignment.world_size))

    def parameters(self):
        """This rank's local parameter shards, for the user's optimizer (fp32 masters under mixed
        precision)."""
        module = self.module()
        if self._masters is None:
            return module.parameters()
        return iter(self._masters.stepped(module.stored, [s.fqn for s in self._stored if s.kind == "parameter"]))

    def _parameter(self, fqn: str) -> torch.Tensor:
        """What the optimizer steps for stored tensor ``fqn`` as a piece of the storage sharding: its
        master, its ZeRO shards gathered (collective), else the tensor itself."""
        return stepped_piece(self._masters, fqn, self.module().stored)

    def stored_tensors(self) -> list[tuple[str, str, tuple, torch.Tensor]]:
        """``(FQN, "parameter" | "buffer", storage sharding, local tensor)`` of every parameter
        and buffer this rank stores (builds the module on first call; collective)."""
        return [(s.fqn, s.kind, tuple(s.sharding), self._parameter(s.fqn))
                for s in self._stored if s.kind in ("parameter", "buffer")]

    def _flat_inputs(self, inputs, target) -> list:
        return flatten_inputs(inputs, target, kwarg_order=self._kwarg_order, names=[i.name for i in self._inputs])

    def local_inputs(self, inputs, target=None) -> list:
        """This rank's pieces of a global batch (cut by the user inputs' shardings; floating ones in
        the compute dtype under mixed precision)."""
        module = self.module()
        out = []
        for i, x in enumerate(self._flat_inputs(inputs, target)):
            if isinstance(x, torch.Tensor):
                for d, start, length in self._cuts(i, x.shape, module._mesh.coord):
                    x = x.narrow(d, start, length)
                dtype = self.precision.dtype(x.dtype) if self.precision.master else x.dtype  # the bf16 copy's
                if x.device != self._module_device or x.dtype != dtype:
                    x = x.to(self._module_device, dtype)
                x = x.contiguous()
            out.append(x)
        return out

    def _cuts(self, index: int, shape, coord) -> tuple:
        """``(dim, start, length)`` narrowings that cut this rank's piece of user input ``index``
        (cached per shape: they run on every step)."""
        key = (index, tuple(shape))
        if key not in self._input_cuts:
            self._input_cuts[key] = piece_cuts(key[1], self._inputs[index].sharding, self.mesh_shape, coord)
        return self._input_cuts[key]

    def forward(self, inputs, target=None, *, wait: bool = True):
        """Run this rank's program on a global batch; returns its outputs (local pieces)."""
        module = self.module()
        if self._masters is not None:
            self._masters.refresh(module.stored)
        local = iter(self.local_inputs(inputs, target))
        args = [getattr(*where) if where is not None else next(local) for where in self._where]
        return module(*args, wait=wait)

    def step(self, inputs, target=None) -> torch.Tensor:
        """Forward and backward on a global batch; returns the loss as a detached 0-dim tensor
        (no host sync). Gradients add up in ``parameters()`` over several steps (accumulation)
        until the optimizer's ``zero_grad``. Under fp16 mixed precision the backward is the loss's
        times the loss scale, and the gradients stay scaled until :meth:`unscale_`."""
        if self._loss_index is None:
            raise CodegenError("the captured model returns no loss; capture it with labels or a loss_fn")
        self.module()
        scaler = self._scaler
        if scaler is not None:
            scaler.check_backward(self._masters.owned())
        reset_pending()
        outputs = self.forward(inputs, target, wait=False)
        loss = outputs[self._loss_index]
        # reads only the loss's shape: its all-reduce may still be in flight
        loss.backward(scaler.loss_gradient(loss) if scaler is not None else None)
        wait_outputs()
        self.module().apply_mutations(outputs)
        if self._masters is not None:
            self._masters.take_gradients(self.module().stored)
        if scaler is not None:
            scaler.took_gradients(self._masters.owned())
        return loss.detach()

    def unscale_(self) -> None:
        """Under fp16 mixed precision divide the gradients in ``parameters()`` by the loss scale
        (once per optimizer step; collective: the overflow flag's all-reduce). :meth:`clip_grad_norm_`,
        :meth:`full_gradients` and :meth:`optimizer_step` call it first; other precisions do nothing."""
        self.module()
        if self._scaler is not None:
            self._scaler.unscale_(self._masters.owned())

    def optimizer_step(self, optimizer) -> bool:
        """``optimizer.step()`` (an optimizer over :meth:`parameters`); under fp16 mixed precision
        unless a gradient on some rank overflowed, then the loss scale moves
        (:mod:`autopar.runtime.scaler`). Returns whether it stepped (the same on every rank)."""
        self.module()
        return step_optimizer(self._scaler, optimizer, self._masters)

    @property
    def loss_scaler(self):
        """The :class:`~autopar.runtime.scaler.LossScaler` (``.scale``: the next step's) of a
        started program under fp16 mixed precision, else None."""
        return self._scaler if self._module is not None else None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the norm of all of them together, over every shard, is
        at most ``max_norm``; returns that norm before scaling (collective; as
        ``torch.nn.utils.clip_grad_norm_`` on the whole model in one process)."""
        module = self.module()
        self.unscale_()
        zero = self._masters if isinstance(self._masters, ZeroShards) else None
        return clip_grad_norm_([zero.clip_entry(s.fqn, s.sharding) if zero and s.fqn in zero.shards
                                else (self._parameter(s.fqn), s.sharding, True) for s in self._stored if s.trainable],
                               max_norm, norm_type, mesh=module._mesh, device=self._module_device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered whole (collective: call on every rank), with tied
        aliases pointing at the same tensor."""
        return self._gather({s.fqn: self._parameter(s.fqn) for s in self._stored if s.kind != "constant"})

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's ``.grad`` gathered whole (collective), by FQN; unscaled
        under fp16 mixed precision."""
        self.unscale_()
        grads = {}
        zero = self._masters if isinstance(self._masters, ZeroShards) else None
        for s in self._stored:
            if zero is not None and s.fqn in zero.shards:
                grads[s.fqn] = zero.gradient_piece(s.fqn)
            elif s.trainable:
                g = self._parameter(s.fqn).grad
                grads[s.fqn] = torch.zeros_like(self._parameter(s.fqn)) if g is None else g
        return self._gather(grads)

    def _gather(self, local: dict) -> dict[str, torch.Tensor]:
        local = {fqn: t.to(self._module_device) for fqn, t in local.items()}  # an offloaded master's from the host
        out = gather_whole(local, {s.fqn: s.sharding for s in self._stored}, self.module()._mesh)
        for alias, canon in self._tied.items():
            if canon in out:
                out[alias] = out[canon]
        return out

    def describe_storage(self) -> str:
        """One line per stored tensor: FQN, storage sharding."""
        return "\n".join(f"{s.fqn}: {format_sharding(s.sharding)}" for s in self._stored)


def flatten_inputs(inputs, target, *, kwarg_order, names) -> list:
    """A global batch (positional tuple, keyword dict or one tensor; ``target`` for a folded loss)
    as the graph's user inputs in placeholder order (``names``: their names, for messages)."""
    if isinstance(inputs, tuple) and not kwarg_order and len(inputs) + (target is not None) == len(names) \
            and all(isinstance(x, torch.Tensor) for x in inputs):  # the common case, cheaply
        return [*inputs, target] if target is not None else list(inputs)
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    if target is not None:  # a folded loss takes it as keyword "target" or as the last argument
        if "target" in kwarg_order:
            kwargs["target"] = target
        else:
            args = args + (target,)
    order = [k for k in kwarg_order if k in kwargs] + [k for k in kwargs if k not in kwarg_order]
    leaves = pytree.tree_leaves((args, {k: kwargs[k] for k in order}))
    if len(leaves) != len(names):
        leaves = [x for x in leaves if isinstance(x, torch.Tensor)]
    if len(leaves) != len(names):
        raise CodegenError(
            f"the program takes {len(names)} inputs ({list(names)})"
            f" but got {len(leaves)}; pass the same inputs (and target) as at capture"
        )
    return leaves


def gather_whole(local: dict, shardings: dict, mesh: RankMesh) -> dict[str, torch.Tensor]:
    """Each tensor of ``local`` (this rank's piece, stored ``shardings[fqn]`` on ``mesh``)
    gathered whole on CPU (collective over the mesh's groups)."""
    out = {}
    with torch.no_grad():
        for fqn, t in local.items():
            t = t.detach()
            for axis in reversed(range(len(mesh.mesh_shape))):
                p = shardings[fqn][axis]
                if isinstance(p, Shard):
                    t = all_gather(t, mesh.axis(axis), p.dim)
            out[fqn] = t.cpu()
    return out


def _tensor_outputs(captured):
    """``(index among the graph's tensor outputs, GraphOutput)`` for each tensor output."""
    out_node = captured.graph_module.graph.output_node()
    leaves = pytree.tree_leaves(out_node.args)
    if len(leaves) != len(captured.outputs):
        raise CodegenError(f"the graph returns {len(leaves)} values but capture describes"
                           f" {len(captured.outputs)}")
    index = 0
    for leaf, out in zip(leaves, captured.outputs):
        if is_tensor_node(leaf):
            yield index, out
            index += 1


def _store_mutations(assignment: ShardingAssignment, mutations, stored) -> ShardingAssignment:
    """The assignment with each mutated buffer's new value resharded to the buffer's storage."""
    if not mutations:
        return assignment
    storage = {s.fqn: s.sharding for s in stored}
    outs = list(assignment.output_shardings)
    for index, fqn in mutations:
        if fqn not in storage:
            raise CodegenError(f"the graph updates buffer {fqn!r}, which is not one of its inputs")
        outs[index] = storage[fqn]
    return dataclasses.replace(assignment, output_shardings=tuple(outs))


__all__ = ["DistributedModule", "DistributedProgram"]
