"""Sharded training checkpoints that load under another plan or world size.

::

    from autopar import checkpoint

    checkpoint.save(compiled, f"ckpt/step-{step}", optimizer=opt, step=step)   # every rank
    path = checkpoint.latest("ckpt")                                           # None: start fresh
    step = checkpoint.load(other_compiled, path, optimizer=other_opt)          # every rank

Each rank hands its local shards to ``torch.distributed.checkpoint`` (DCP) as DTensors on the
plan's mesh with the plan's storage placements, so DCP records where every piece sits in the
whole tensor; loading into a program of another plan (tensor parallel → data parallel, 4 ranks →
2) reads exactly the pieces each rank now holds. An optimizer state shaped like its parameter's
local shard (Adam's moments) is sharded like the parameter; a 0-dim state (Adam's ``step``) is
replicated. Everything that is not a tensor (the step, optimizer hyper-parameters, names, global
shapes and dtypes) goes to ``autopar.json`` in the checkpoint directory: JSON, never pickle.
Under mixed precision the parameters saved and loaded are the fp32 masters (the program's bf16
copies follow from them at the next step; :mod:`autopar.runtime.mixed`). A ZeRO-1/2 program
(:mod:`autopar.runtime.zero`) saves its parameters and its optimizer's per-element state gathered
from their flat shards over the ZeRO axes, one tensor at a time, as pieces of the parameter's
storage sharding: the same files as a program without ZeRO, so either loads the other's; loading
cuts each rank's shard from them again. A parameter several pipeline stages hold (a tied
embedding, perhaps sharded differently on each stage's mesh) is saved by its first stage only
and loaded by all. Under fp16 mixed precision the loss scaler's state
(:mod:`autopar.runtime.scaler`) is saved and loaded with the optimizer's. DCP
itself writes its ``.metadata`` index with pickle, so load checkpoints only from places you trust.

A checkpoint is written into ``<path>.partial`` and renamed to ``<path>`` once every rank has
finished: a rank killed mid-save leaves the previous checkpoints as they were and no ``<path>``,
and :func:`latest` only returns complete checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch
import torch.distributed as dist

from autopar.core.errors import CheckpointError
from autopar.core.placement import Replicate, Shard

FORMAT = "autopar-checkpoint"
VERSION = 1
META = "autopar.json"
_PARTIAL = ".partial"


# ----------------------------------------------------------------------------- public API


_CALL_MESHES: dict | None = None  # mesh shape -> DeviceMesh, shared inside one save() or load()


@contextlib.contextmanager
def _meshes_for_this_call():
    """DeviceMeshes live for one save() or load(): a kept DeviceMesh would keep its process
    groups alive past destroy_process_group (:mod:`autopar.comm.groups`)."""
    global _CALL_MESHES
    _CALL_MESHES = {}
    try:
        yield
    finally:
        _CALL_MESHES = None


@_meshes_for_this_call()
def save(program, path, *, optimizer=None, step: int = 0) -> None:
    """Write ``program``'s parameters and buffers (and ``optimizer``'s state) to directory
    ``path``. Collective: call on every rank with the same ``path``. ``program`` is a
    :class:`~autopar.runtime.program.DistributedProgram` or a compiled model (``.program``)."""
    import torch.distributed.checkpoint as dcp

    program, plan = _program_and_plan(program)
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    path = os.fspath(path)
    partial = path + _PARTIAL
    rank = _rank()
    if rank == 0:
        if os.path.exists(partial):  # left by a save that was killed
            shutil.rmtree(partial)
        os.makedirs(partial)
    _barrier()
    tensors, meta = _model_state(program)
    copies = _copies(program)
    state = {f"model.{fqn}": t for fqn, t in tensors.items() if fqn not in copies}
    meta = {"format": FORMAT, "version": VERSION, "step": step, "world_size": _world(),
            "mesh_shape": list(program.mesh_shape), "plan": _plan_meta(plan),
            "tensors": _on_every_rank(meta),
            "optimizer": None}
    if optimizer is not None:
        opt_tensors, mine = _optimizer_state(program, optimizer)
        meta["optimizer"] = _merged_optimizer(_all_objects(mine))
        scaler = program.loss_scaler
        meta["loss_scale"] = scaler.state_dict() if scaler is not None else None
        state.update({f"optim.{fqn}.{key}": t for (fqn, key), t in opt_tensors.items() if fqn not in copies})
    dcp.save(state, checkpoint_id=partial)
    if rank == 0:
        with open(os.path.join(partial, META), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _replace_dir(partial, path)
    _barrier()


@_meshes_for_this_call()
def load(program, path, *, optimizer=None) -> int:
    """Read a checkpoint written by :func:`save` into ``program`` (and ``optimizer``, a fresh
    optimizer over ``program.parameters()``); returns the saved step. Collective. The program may
    come from another plan or world size than the one that saved: tensors are resharded."""
    import torch.distributed.checkpoint as dcp

    program, _ = _program_and_plan(program)
    path = os.fspath(path)
    meta = read_meta(path)
    tensors, mine = _model_state(program)
    _check_same_model(meta["tensors"], _on_every_rank(mine), path)
    state = {f"model.{fqn}": t for fqn, t in tensors.items()}
    opt_state = {}
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise CheckpointError(f"{path} holds no optimizer state: load without optimizer= (and"
                                  " start the optimizer afresh) or resume from a checkpoint saved"
                                  " with save(..., optimizer=opt)")
        opt_state = _empty_optimizer_state(program, optimizer, meta["optimizer"], path)
        state.update({f"optim.{fqn}.{key}": t for (fqn, key), t in opt_state.items()})
    with torch.no_grad():
        dcp.load(state, checkpoint_id=path)
    shards = _shards(program)
    for fqn in shards.shards if shards is not None else ():
        t = tensors[fqn]  # gathered from the shards: loaded into a copy
        shards.load_piece(fqn, t.to_local() if _is_dtensor(t) else t)
    if optimizer is not None:
        _install_optimizer_state(program, optimizer, meta["optimizer"], opt_state)
        if meta.get("loss_scale") is not None and program.loss_scaler is not None:
            program.loss_scaler.load_state_dict(meta["loss_scale"])
    return int(meta["step"])


def latest(directory) -> str | None:
    """The complete checkpoint under ``directory`` with the highest step (None if there is none);
    half-written ``*.partial`` directories are skipped."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    best, best_step = None, -1
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(_PARTIAL) or not os.path.isfile(os.path.join(path, META)):
            continue
        step = read_meta(path)["step"]
        if step > best_step:
            best, best_step = path, step
    return best


def read_meta(path) -> dict:
    """The checkpoint's ``autopar.json`` (step, world size, mesh, tensor names, shapes, dtypes),
    validated."""
    path = os.fspath(path)
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise CheckpointError(f"no autopar checkpoint at {path} ({META} is missing): pass a directory"
                              " written by autopar.runtime.checkpoint.save, or use latest(dir) to find one")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is corrupt ({exc}); resume from an earlier checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not an autopar checkpoint description; resume from a"
                              " directory written by autopar.runtime.checkpoint.save")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {meta.get('version')!r}; this"
                              f" autopar reads version {VERSION}: upgrade autopar to load it")
    for key, kind in (("step", int), ("tensors", dict), ("world_size", int)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{file} is corrupt (field {key!r} missing or not {kind.__name__});"
                                  " resume from an earlier checkpoint")
    return meta


def full_optimizer_state(program, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """``{parameter FQN: {state name: whole tensor}}`` gathered from every rank (collective)."""
    program, _ = _program_and_plan(program)
    tensors, _ = _optimizer_state(program, optimizer)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (fqn, key), t in tensors.items():
        whole = t.full_tensor() if _is_dtensor(t) else t
        out.setdefault(fqn, {})[key] = whole.detach().cpu().clone()
    return out


# ----------------------------------------------------------------------------- model tensors


def _program_and_plan(obj):
    """The program (a DistributedProgram or PipelineProgram: anything with ``storage_mesh``) and
    its plan, of a program or a compiled model."""
    if hasattr(obj, "storage_mesh"):
        return obj, getattr(obj, "plan", None)
    program = getattr(obj, "program", None)
    if hasattr(program, "storage_mesh"):
        return program, getattr(obj, "plan", None)
    raise CheckpointError(f"expected a DistributedProgram, a PipelineProgram or a compiled model"
                          f" (autopar.compile(...)), got {type(obj).__name__}")


def _plan_meta(plan) -> dict | None:
    if plan is None:
        return None
    return {"name": plan.name, "fingerprint": plan.fingerprint, "mesh_shape": list(plan.mesh_shape)}


def _global_shape(local, sharding, mesh_shape) -> list[int]:
    shape = list(local.shape)
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh_shape[axis]
    return shape


def _model_state(program):
    """DCP state of the model (DTensors where sharded) and its description for autopar.json."""
    tensors, meta = {}, {}
    mesh_shape = program.storage_mesh()[0].mesh_shape
    for fqn, kind, sharding, local in program.stored_tensors():
        tensors[fqn] = _wrap(local.detach(), sharding, program)
        meta[fqn] = {"kind": kind, "shape": _global_shape(local, sharding, mesh_shape),
                     "dtype": str(local.dtype).removeprefix("torch.")}
    return tensors, meta


def _copies(program) -> frozenset:
    """FQNs this rank holds as copies that another pipeline stage saves (a tied parameter held by
    several stages, perhaps sharded differently there: saved once, by its first stage)."""
    return getattr(program, "copies", frozenset())


def _all_objects(mine) -> list:
    """Every rank's ``mine`` (collective)."""
    everyone: list = [None] * _world()
    dist.all_gather_object(everyone, mine)
    return everyone


def _on_every_rank(mine: dict) -> dict:
    """The union of every rank's tensor descriptions (a pipeline stage holds only its own)."""
    return {fqn: d for part in _all_objects(mine) for fqn, d in part.items()}


def _check_same_model(saved: dict, mine: dict, path) -> None:
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(
            f"{path} was saved from a different model: missing {missing[:5]}, unexpected"
            f" {extra[:5]}; load it into the model it was saved from")
    for fqn, want in mine.items():
        got = saved[fqn]
        if list(got.get("shape", ())) != want["shape"] or got.get("dtype") != want["dtype"]:
            raise CheckpointError(
                f"{path} was saved from a different model: {fqn} is {got.get('dtype')}"
                f" {got.get('shape')} there but {want['dtype']} {want['shape']} here; load it into"
                " the model it was saved from")


# ----------------------------------------------------------------------------- optimizer


def _shards(program):
    """The ZeRO shards ``program``'s optimizer steps, or None."""
    return getattr(program, "optimizer_shards", None)


def _param_names(program, optimizer) -> list[list[str]]:
    """The FQN of every parameter of every param group of ``optimizer`` (a ZeRO shard's is its
    parameter's)."""
    by_id = {id(t): fqn for fqn, kind, _, t in program.stored_tensors() if kind == "parameter"}
    shards = _shards(program)
    by_id.update({id(t): fqn for fqn, t in (shards.shards.items() if shards is not None else ())})
    groups = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError("the optimizer holds a tensor that is not one of the program's"
                                      " parameters: build it over program.parameters()")
            names.append(by_id[id(p)])
        groups.append(names)
    return groups


def _optimizer_state(program, optimizer):
    """{(FQN, state name): tensor, DTensor where sharded} and the JSON description."""
    storage = {fqn: (sharding, t) for fqn, _, sharding, t in program.stored_tensors()}
    names = _param_names(program, optimizer)
    shards = _shards(program)
    tensors, state_meta = {}, {}
    for group, fqns in zip(optimizer.param_groups, names):
        for p, fqn in zip(group["params"], fqns):
            sharding, local = storage[fqn]
            sharded = shards is not None and fqn in shards.shards
            entry = {}
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"optimizer state {key!r} of {fqn} is a {type(value).__name__};"
                                          " autopar checkpoints tensor states only")
                if sharded and value.dim() and value.shape == p.shape:  # gathered from the ZeRO shards
                    tensors[(fqn, key)] = _wrap(shards.state_piece(fqn, value), sharding, program)
                    entry[key] = {"like": "parameter", "dtype": str(value.dtype).removeprefix("torch.")}
                elif value.shape == local.shape:
                    tensors[(fqn, key)] = _wrap(value.detach(), sharding, program)
                    entry[key] = {"like": "parameter", "dtype": str(value.dtype).removeprefix("torch.")}
                elif value.dim() == 0 or not any(isinstance(x, Shard) for x in sharding):
                    tensors[(fqn, key)] = value.detach()
                    entry[key] = {"like": "replicated", "shape": list(value.shape),
                                  "dtype": str(value.dtype).removeprefix("torch.")}
                else:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {fqn} has shape {tuple(value.shape)}, neither the"
                        f" local parameter's {tuple(local.shape)} nor a scalar, so its sharding is"
                        " unknown; use an optimizer with per-element states (SGD, Adam, AdamW)")
            state_meta[fqn] = entry
    groups = [{"params": fqns, **_hyper(group)} for group, fqns in zip(optimizer.param_groups, names)]
    return tensors, {"class": type(optimizer).__name__, "param_groups": groups, "state": state_meta}


def _merged_optimizer(metas: list[dict]) -> dict:
    """One description of every rank's optimizer (each pipeline stage's holds its own parameters):
    each param group's parameters from every rank, and every parameter's state."""
    first = metas[0]
    if any(len(m["param_groups"]) != len(first["param_groups"]) or m["class"] != first["class"] for m in metas):
        raise CheckpointError("the ranks' optimizers differ in class or number of param groups: build the same"
                              " optimizer, with the same groups, on every rank")
    groups = [dict(g, params=list(dict.fromkeys(p for m in metas for p in m["param_groups"][k]["params"])))
              for k, g in enumerate(first["param_groups"])]
    state = {fqn: entry for m in metas for fqn, entry in m["state"].items()}
    return {"class": first["class"], "param_groups": groups, "state": state}


def _hyper(group: dict) -> dict:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"optimizer setting {key}={value!r} cannot be stored as JSON") from None
        out[key] = value
    return out


def _empty_optimizer_state(program, optimizer, saved: dict, path):
    """Tensors (DTensors where sharded) to load the saved optimizer state into."""
    if saved.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"{path} holds {saved.get('class')} state but the optimizer is a"
                              f" {type(optimizer).__name__}: resume with the same optimizer class")
    names = _param_names(program, optimizer)
    saved_groups = [g["params"] for g in saved["param_groups"]]
    if len(names) != len(saved_groups) or not all(set(g) <= set(h) for g, h in zip(names, saved_groups)):
        raise CheckpointError(f"{path}'s optimizer has param groups {saved_groups}, this one"
                              f" {names}: build the optimizer with the same groups")
    storage = {fqn: (sharding, t) for fqn, _, sharding, t in program.stored_tensors()}
    tensors = {}
    for fqn, entry in saved["state"].items():
        if fqn not in storage:  # another pipeline stage's
            continue
        sharding, local = storage[fqn]
        for key, info in entry.items():
            dtype = getattr(torch, info["dtype"])
            if info["like"] == "parameter":
                tensors[(fqn, key)] = _wrap(torch.zeros_like(local, dtype=dtype), sharding, program)
            else:
                tensors[(fqn, key)] = torch.zeros(info["shape"], dtype=dtype)
    return tensors


def _install_optimizer_state(program, optimizer, saved: dict, loaded: dict) -> None:
    names = _param_names(program, optimizer)
    params = {fqn: p for group, fqns in zip(optimizer.param_groups, names) for p, fqn in zip(group["params"], fqns)}
    shards = _shards(program)
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(value, list) else value
    for (fqn, key), t in loaded.items():
        local = t.to_local() if _is_dtensor(t) else t
        if shards is not None and fqn in shards.shards and saved["state"][fqn][key]["like"] == "parameter":
            local = shards.state_chunk(fqn, local)  # this rank's chunk of the piece
        optimizer.state[params[fqn]][key] = local


# ----------------------------------------------------------------------------- DTensor, files


def _device_mesh(program):
    """A DeviceMesh over the mesh axes of size > 1 of the program's storage mesh (a pipeline
    stage's own), built from autopar's process groups."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh, ranks = program.storage_mesh()
    key = (mesh.mesh_shape, tuple(ranks))
    if _CALL_MESHES is not None and key in _CALL_MESHES:
        return _CALL_MESHES[key]
    axes = [a for a, n in enumerate(mesh.mesh_shape) if n > 1]
    groups = [mesh.group(a) for a in axes]
    grid = torch.tensor(ranks).reshape(tuple(mesh.mesh_shape[a] for a in axes))
    device_mesh = DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], "cpu", mesh=grid,
                                        mesh_dim_names=tuple(f"ckpt{a}" for a in axes))
    if _CALL_MESHES is not None:
        _CALL_MESHES[key] = device_mesh
    return device_mesh


def _wrap(local: torch.Tensor, sharding, program):
    """``local`` as a DTensor with ``sharding`` on the program's storage mesh (a plain tensor
    when it is whole on this rank)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    mesh_shape = program.storage_mesh()[0].mesh_shape
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    if not any(isinstance(sharding[a], Shard) for a in axes):
        return local
    placements = []
    for a in axes:
        p = sharding[a]
        if isinstance(p, Shard):
            placements.append(TShard(p.dim))
        elif isinstance(p, Replicate):
            placements.append(TReplicate())
        else:
            raise CheckpointError(f"a stored tensor has placement {p}; storage is S(d) or R only")
    return DTensor.from_local(local, _device_mesh(program), placements, run_check=False)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _replace_dir(src: str, dst: str) -> None:
    """Move directory ``src`` to ``dst``, replacing an older ``dst`` (kept until the move)."""
    old = None
    if os.path.exists(dst):
        old = f"{dst}.old-{os.getpid()}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if not dist.is_initialized():
        raise CheckpointError("checkpoints of a distributed program need torch.distributed"
                              " initialised: call save/load on every rank of the job")
    dist.barrier()


__all__ = ["full_optimizer_state", "latest", "load", "read_meta", "save"]
