"""Where a program's weights come from: each rank makes only the pieces it stores.

A program takes a :class:`ModelWeights` from the model when it is built (it pickles: a real
model's tensors, or a model on ``device="meta"`` itself), and each rank asks it for its pieces::

    weights = ModelWeights(stored, model=model)
    pieces = weights.pieces(stored_here, mesh_shape, coord, device, checkpoint=None)   # {fqn: piece}

- no checkpoint: pieces cut from the model's tensors; a tensor on meta comes from the model's
  initialisers, one whole tensor at a time (:mod:`~autopar.runtime.materialize`), so a rank
  holds its pieces and about one whole parameter;
- a Hugging Face folder (``save_pretrained``: ``model.safetensors``, or shards with
  ``model.safetensors.index.json``): each rank reads only the slices it stores
  (``safe_open(...).get_slice``), under the name transformers wrote (a tied weight under any of
  its names, the base model's prefix present or not); what the folder lacks (non-persistent
  buffers such as rotary frequencies) comes from the model as without a checkpoint;
- an autopar checkpoint directory (:mod:`autopar.runtime.checkpoint`, any plan or world size):
  uninitialised pieces, which the program then fills with ``checkpoint.load``.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
from torch import nn

from autopar.core.errors import CheckpointError, CodegenError
from autopar.core.layout import local_piece, piece_of
from autopar.core.placement import local_shape
from autopar.runtime.materialize import initialise

HF_INDEX = "model.safetensors.index.json"
AUTOPAR_META = "autopar.json"  # what marks an autopar checkpoint directory (checkpoint.META)


def checkpoint_kind(path) -> str:
    """``"hf"`` for a Hugging Face safetensors folder, ``"autopar"`` for an autopar checkpoint."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, AUTOPAR_META)):
        return "autopar"
    if os.path.isdir(path) and any(name.endswith(".safetensors") for name in os.listdir(path)):
        return "hf"
    raise CheckpointError(f"{path} is neither a Hugging Face folder (save_pretrained's *.safetensors) nor an"
                          f" autopar checkpoint ({AUTOPAR_META}): pass one of those, or checkpoint=None to"
                          " start from the model")


def tensors_of(model, state_dict):
    """``({FQN: tensor}, {parameter FQN: requires_grad})`` of a model (every name of a tied
    tensor) or of a state dict."""
    if model is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        tensors = {**dict(model.named_buffers(remove_duplicate=False)), **params}
        return tensors, {k: p.requires_grad for k, p in params.items()}
    return dict(state_dict), {}


class ModelWeights:
    """The tensors a program stores (``stored``: its :class:`~autopar.plan.stored.Stored`
    entries), as the model, a ``state_dict`` or the captured ``constants`` give them; ``tied``
    maps an alias FQN to its canonical one. ``error`` is the exception class for a tensor that
    is missing."""

    def __init__(self, stored, *, model: nn.Module | None = None, state_dict=None, constants=None, tied=None,
                 error=CodegenError):
        tensors, self.trainable = tensors_of(model, state_dict)
        self.global_meta: dict[str, tuple] = {}  # fqn -> (shape, dtype)
        self.tensors: dict[str, torch.Tensor] = {}  # fqn -> whole tensor (not on meta)
        self.model = None  # the model, when a tensor must come from its initialisers
        for s in stored:
            source = (constants or {}) if s.kind == "constant" else tensors
            if s.fqn not in source:
                raise error(f"no tensor for {s.kind} {s.fqn!r} in the model/state_dict given")
            t = source[s.fqn].detach()
            self.global_meta[s.fqn] = (tuple(t.shape), t.dtype)
            if not t.is_meta:
                self.tensors[s.fqn] = t
            elif s.kind == "constant" or model is None:
                raise error(f"{s.kind} {s.fqn!r} is on the meta device and nothing initialises it: build the"
                            " model on a real device, pass its state_dict, or make it a buffer that its"
                            " module's reset_parameters() sets")
            else:
                self.model = model
        self.aliases: dict[str, list[str]] = {}
        for alias, canon in (tied or {}).items():
            self.aliases.setdefault(canon, []).append(alias)
        self.prefix = getattr(model, "base_model_prefix", "") or ""

    # ------------------------------------------------------------------ pieces

    def pieces(self, stored, mesh_shape, coord, device, checkpoint=None) -> dict[str, torch.Tensor]:
        """This rank's piece of every tensor of ``stored`` (here at ``coord`` on ``mesh_shape``),
        on ``device``, from ``checkpoint`` (a path, or None: the model)."""
        want = {s.fqn: s.sharding for s in stored}
        kind = None if checkpoint is None else checkpoint_kind(checkpoint)
        if kind == "autopar":  # filled by checkpoint.load
            return {fqn: torch.empty(local_shape(self.global_meta[fqn][0], sh, mesh_shape),
                                     dtype=self.global_meta[fqn][1], device=device) for fqn, sh in want.items()}
        out: dict[str, torch.Tensor] = {}
        if kind == "hf":
            out.update(self._from_folder(os.fspath(checkpoint), want, mesh_shape, coord, device))
        rest = {fqn: sh for fqn, sh in want.items() if fqn not in out}
        out.update(self._from_model(rest, mesh_shape, coord, device, loaded=set(out)))
        return out

    def _cut(self, whole, sharding, mesh_shape, coord, device, dtype=None) -> torch.Tensor:
        piece = local_piece(whole, sharding, mesh_shape, coord)
        return piece.to(device=device, dtype=dtype, copy=True).contiguous()

    def _from_model(self, want: dict, mesh_shape, coord, device, loaded=frozenset()) -> dict:
        out = {fqn: self._cut(self.tensors[fqn], sh, mesh_shape, coord, device)
               for fqn, sh in want.items() if fqn in self.tensors}
        init = {fqn: sh for fqn, sh in want.items() if fqn not in out}
        if not init:
            return out

        def keep(fqn, whole):
            if fqn in init:
                out[fqn] = self._cut(whole, init[fqn], mesh_shape, coord, device)

        skip = {name for fqn in loaded for name in (fqn, *self.aliases.get(fqn, ()))}
        unset = initialise(self.model, keep, device=device, skip=skip) & set(init)
        if unset:
            raise CodegenError(f"the model is on the meta device and its initialisers set no value for"
                               f" {sorted(unset)[:5]}: give their modules a reset_parameters() that sets"
                               " them, or start from a checkpoint (runner(checkpoint=...))")
        return out

    # ------------------------------------------------------------------ Hugging Face folders

    def _names(self, fqn: str) -> list[str]:
        """The names transformers may have written ``fqn`` under."""
        out = []
        for name in (fqn, *self.aliases.get(fqn, ())):
            out.append(name)
            if self.prefix:
                out.append(name.removeprefix(self.prefix + ".") if name.startswith(self.prefix + ".")
                           else f"{self.prefix}.{name}")
        return out

    def _from_folder(self, folder: str, want: dict, mesh_shape, coord, device) -> dict:
        files = _folder_index(folder)
        by_file: dict[str, list] = {}
        missing = []
        for fqn in want:
            name = next((n for n in self._names(fqn) if n in files), None)
            if name is not None:
                by_file.setdefault(files[name], []).append((fqn, name))
            elif fqn in self.trainable:
                missing.append(fqn)
        if missing:
            warnings.warn(f"{folder} has no tensor for {sorted(missing)[:5]} (of {len(missing)}): they start"
                          " from the model (its tensors, or its initialisers on meta)", stacklevel=4)
        from safetensors import safe_open  # optional: only Hugging Face folders need it

        out = {}
        for file, entries in sorted(by_file.items()):
            with safe_open(os.path.join(folder, file), framework="pt", device="cpu") as f:
                for fqn, name in entries:
                    part = f.get_slice(name)
                    shape, dtype = self.global_meta[fqn]
                    if tuple(part.get_shape()) != shape:
                        raise CheckpointError(f"{folder}: {name} has shape {tuple(part.get_shape())} but the"
                                              f" model's {fqn} is {shape}: load the checkpoint of this model")
                    piece = piece_of(shape, want[fqn], mesh_shape, coord)
                    cut = part[tuple(slice(a, b) for a, b in zip(piece.starts, piece.stops))] if shape else part[()]
                    out[fqn] = cut.to(device=device, dtype=dtype).contiguous()
        return out


def _folder_index(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a ``save_pretrained`` folder."""
    index = os.path.join(folder, HF_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    from safetensors import safe_open

    out = {}
    for file in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt", device="cpu") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


__all__ = ["ModelWeights", "checkpoint_kind", "tensors_of"]
