"""A rank's pieces without a whole model, in one process (the multi-process runs are in
tests/test_runtime_big_start.py):

- a meta model's initialisers, run one tensor at a time, give every tensor the value one process
  gets from ``to_empty()`` and the same initialisers under the same seed, draw the same random
  numbers (the RNG ends in the same state), and hold at most a couple of whole tensors at once;
- a Hugging Face folder's slices are the pieces of the saved tensors, found under the names
  transformers writes (a tied weight under its other name, the base model's prefix);
- a program captured on meta reads the rank's device when it runs: no ``meta`` in its code.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from autopar import zoo
from autopar.core.errors import CheckpointError, CodegenError
from autopar.core.layout import local_piece
from autopar.core.placement import R, Shard
from autopar.passes.capture.training import capture_for_training
from autopar.plan.stored import Stored
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram
from autopar.runtime.materialize import initialise
from autopar.runtime.weights import ModelWeights, checkpoint_kind
from models import ResidualStack, TiedBatchNorm
from one_process import initialised

pytest.importorskip("transformers")

CPU = torch.device("cpu")


def _meta(name):
    if name in ("llama", "gpt2", "bert"):
        return getattr(zoo, name)(device="meta")[0]
    with torch.device("meta"):
        return ResidualStack(depth=3, width=8, head=5) if name == "residual" else TiedBatchNorm()


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "residual", "tied-batchnorm"])
def test_initialising_tensor_by_tensor_equals_to_empty_and_the_models_initialisers(name):
    meta = _meta(name)
    want = initialised(meta, seed=3)
    after_want = torch.rand(4)
    got, alive, most_alive = {}, [], 0

    def keep(fqn, whole):
        nonlocal most_alive
        alive.append(weakref.ref(whole.untyped_storage()))
        most_alive = max(most_alive, sum(r() is not None for r in alive))
        got[fqn] = whole.clone()

    torch.manual_seed(3)
    unset = initialise(meta, keep, device=CPU)
    assert torch.equal(torch.rand(4), after_want), "the initialisers drew other random numbers than one process"
    assert unset == set()
    assert all(p.is_meta for p in meta.parameters()), "the user's model was changed"
    tied = {n for n, p in meta.named_parameters(remove_duplicate=False)} - {n for n, _ in meta.named_parameters()}
    state = {**dict(want.named_buffers()), **dict(want.named_parameters(remove_duplicate=False))}
    for fqn, t in state.items():
        if fqn in tied and not hasattr(want, "init_weights"):
            continue  # to_empty unties a plain model; the program's tied weight takes its first name
        assert torch.equal(got[fqn], t), fqn
    gc.collect()
    assert most_alive <= 2, f"{most_alive} whole tensors were alive at once"


def test_a_meta_tensor_no_initialiser_sets_is_reported_by_name():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3, device="meta"))
            self.fc = nn.Linear(3, 3, device="meta")

    assert initialise(Bare(), lambda fqn, whole: None, device=CPU) == {"scale"}
    stored = [Stored("p_scale", "parameter", "scale", (R,), True)]
    with pytest.raises(CodegenError, match=r"initialisers set no value for \['scale'\].*reset_parameters"):
        ModelWeights(stored, model=Bare()).pieces(stored, (1,), (0,), CPU)


def _stored(model, mesh_ndim, shard_axis):
    """Every parameter and buffer, dim 0 sharded on mesh axis ``shard_axis`` where it divides."""
    out = []
    for fqn, t in {**dict(model.named_buffers()), **dict(model.named_parameters())}.items():
        sh = [R] * mesh_ndim
        if t.dim() and t.shape[0] % 2 == 0:
            sh[shard_axis] = Shard(0)
        out.append(Stored(f"p_{fqn}", "parameter", fqn, tuple(sh), True))
    return out


@pytest.mark.parametrize("sharded", [False, True])
def test_a_hugging_face_folder_gives_each_rank_the_slices_of_the_saved_tensors(tmp_path, sharded):
    model, _ = zoo.gpt2()
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "5GB")
    assert checkpoint_kind(tmp_path) == "hf"
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    # the tied weight stored under the name the folder lacks (transformers writes transformer.wte)
    stored = [s if s.fqn != "transformer.wte.weight" else Stored("p_lm_head_weight", "parameter", "lm_head.weight",
                                                                  s.sharding, True)
              for s in _stored(model, 2, shard_axis=1)]
    weights = ModelWeights(stored, model=model, tied={"transformer.wte.weight": "lm_head.weight"})
    saved = dict(zoo.gpt2()[0].named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for p in model.parameters():  # the folder, not the model, must be what is read
            p.zero_()
    for coord in [(0, 0), (1, 1)]:
        pieces = weights.pieces(stored, (2, 2), coord, CPU, checkpoint=tmp_path)
        for s in stored:
            assert torch.equal(pieces[s.fqn], local_piece(saved[s.fqn], s.sharding, (2, 2), coord)), s.fqn


def test_names_of_a_base_model_folder_resolve_with_the_prefix_and_missing_weights_warn(tmp_path):
    model, _ = zoo.llama()
    model.model.save_pretrained(tmp_path)  # LlamaModel: names without "model.", no lm_head
    stored = _stored(model, 1, shard_axis=0)
    weights = ModelWeights(stored, model=model)
    with pytest.warns(UserWarning, match=r"no tensor for \['lm_head.weight'\]"):
        pieces = weights.pieces(stored, (2,), (1,), CPU, checkpoint=tmp_path)
    state = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for s in stored:  # the rotary buffers, not saved, and lm_head come from the model
        assert torch.equal(pieces[s.fqn], local_piece(state[s.fqn], s.sharding, (2,), (1,))), s.fqn


def test_a_folder_of_another_shape_and_a_directory_of_neither_kind_are_refused(tmp_path):
    small, _ = zoo.gpt2(hidden=16)
    small.save_pretrained(tmp_path / "small")
    model, _ = zoo.gpt2(hidden=32)
    stored = _stored(model, 1, shard_axis=0)
    with pytest.raises(CheckpointError, match="shape .* but the model's"):
        ModelWeights(stored, model=model).pieces(stored, (2,), (0,), CPU, checkpoint=tmp_path / "small")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a Hugging Face folder"):
        checkpoint_kind(tmp_path / "empty")


def test_a_program_captured_on_meta_makes_its_tensors_on_the_rank_device():
    meta, (args, kwargs) = zoo.llama(device="meta")
    cap = capture_for_training(meta, example_inputs={"input_ids": args[0], "labels": kwargs["labels"].clone()})
    assert any(n.kwargs.get("device") == torch.device("meta") for n in cap.graph_module.graph.nodes)
    batch = {i.node: (Shard(0),) for i in cap.inputs if i.kind == "user_input"}
    assignment = propagate(cap.graph_module, (2,), batch)
    code = DistributedProgram(cap, assignment, model=meta).code(1)
    assert "meta" not in code
    assert "rank_device = p_model_embed_tokens_weight.device" in code
    assert "arange.default(8, device = rank_device" in code
    pinned = DistributedProgram(cap, assignment, model=meta, device=torch.device("cpu")).code(1)
    assert "meta" not in pinned and "rank_device" not in pinned
    assert "device = device(type='cpu')" in pinned
