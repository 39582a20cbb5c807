"""Capture of the zoo models: shapes, module paths, layers, inputs, ties, outputs and errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from autopar import CaptureError, zoo
from autopar.core.errors import ZooError
from autopar.core.ir import TensorMeta
from autopar.passes.capture import capture, distinct_ops, plain_fqn

MODELS = ("gpt2", "llama", "bert", "vit", "resnet", "mlp", "moe")

EXPECTED_LAYERS = {
    "gpt2": ("transformer.h.0", "transformer.h.1"),
    "llama": ("model.layers.0", "model.layers.1"),
    "bert": ("bert.encoder.layer.0", "bert.encoder.layer.1"),
    "vit": ("vit.layers.0", "vit.layers.1"),
    # stage 1 starts with a projection-shortcut block, so only stage 0's blocks are alike
    "resnet": ("resnet.encoder.stages.0.layers.0", "resnet.encoder.stages.0.layers.1"),
    "mlp": (),
    "moe": ("blocks.0", "blocks.1"),
}


@functools.lru_cache(maxsize=None)
def captured(name: str):
    model, (args, kwargs) = getattr(zoo, name)()
    return model, capture(model, args, kwargs=kwargs)


def f32(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), torch.float32)


def calls(cap, op, module_suffix: str = "") -> list[torch.fx.Node]:
    return [n for n in cap.graph_module.graph.nodes
            if n.op == "call_function" and n.target == op
            and n.meta["autopar_module"].endswith(module_suffix)]


aten = torch.ops.aten


# ----------------------------------------------------------------------------- every model


@pytest.mark.parametrize("name", MODELS)
def test_every_node_has_tensor_meta_module_and_layer(name):
    model, cap = captured(name)
    modules = dict(model.named_modules())
    for node in cap.graph_module.graph.nodes:
        assert {"autopar_tensor", "autopar_module", "autopar_layer"} <= node.meta.keys(), node
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor):
            assert node.meta["autopar_tensor"] == TensorMeta(tuple(val.shape), val.dtype)
        assert node.meta["autopar_module"] in modules, (node, node.meta["autopar_module"])
        layer = node.meta["autopar_layer"]
        if layer is not None:
            assert node.meta["autopar_module"] == layer or \
                node.meta["autopar_module"].startswith(layer + ".")
    # fake tensors only: nothing real was allocated for the graph's values
    assert all(isinstance(n.meta["val"], torch._subclasses.FakeTensor)
               for n in cap.graph_module.graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor))
    # most compute happens inside named submodules, not at the root
    compute = [n for n in cap.graph_module.graph.nodes if n.op == "call_function"]
    assert sum(n.meta["autopar_module"] != "" for n in compute) > len(compute) // 2


@pytest.mark.parametrize("name", MODELS)
def test_repeated_layers_found_and_alike(name):
    _, cap = captured(name)
    assert cap.layers == EXPECTED_LAYERS[name]
    per_layer = [[n.target for n in cap.nodes_in_layer(layer) if n.op == "call_function"]
                 for layer in cap.layers]
    assert all(ops and ops == per_layer[0] for ops in per_layer)


@pytest.mark.parametrize("name", MODELS)
def test_inputs_map_to_model_fqns_and_parameters_count_once(name):
    model, cap = captured(name)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    placeholders = [n.name for n in cap.graph_module.graph.nodes if n.op == "placeholder"]
    assert [i.node for i in cap.inputs] == placeholders
    for inp in cap.inputs:
        if inp.kind == "parameter":
            assert inp.name in params and inp.meta.shape == tuple(params[inp.name].shape)
        elif inp.kind == "buffer":
            assert inp.name in buffers and inp.meta.shape == tuple(buffers[inp.name].shape)
    assert set(cap.parameters) == set(params)  # named_parameters() lists a tied weight once
    assert cap.num_parameters == sum(p.numel() for p in model.parameters())
    user = [i.name for i in cap.inputs if i.kind == "user_input"]
    assert user[0] in ("input_ids", "pixel_values", "x")


def test_gpt2_tie_is_one_parameter_used_by_embedding_and_lm_head():
    _, cap = captured("gpt2")
    assert dict(cap.tied) == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in cap.parameters
    (wte,) = [n for n in cap.graph_module.graph.nodes
              if n.op == "placeholder" and n.name == "p_transformer_wte_weight"]
    users = {u.meta["autopar_module"] for u in wte.users}
    assert users == {"transformer.wte", "lm_head"}
    assert [o.kind for o in cap.outputs] == ["loss", "user_output"]
    assert [o.name for o in cap.outputs] == ["loss", "logits"]


def test_bert_ties_decoder_to_word_embeddings():
    _, cap = captured("bert")
    assert cap.tied["cls.predictions.decoder.weight"] == "bert.embeddings.word_embeddings.weight"


# ----------------------------------------------------------------------------- spot-checked shapes


def test_gpt2_shapes():  # batch 2, seq 8, hidden 32, 4 heads, vocab 128
    _, cap = captured("gpt2")
    emb = calls(cap, aten.embedding.default, "transformer.wte")
    assert [n.meta["autopar_tensor"] for n in emb] == [f32(2, 8, 32)]
    sdpa = calls(cap, aten.scaled_dot_product_attention.default)
    assert [n.meta["autopar_tensor"] for n in sdpa] == [f32(2, 4, 8, 8)] * 2
    assert [n.meta["autopar_layer"] for n in sdpa] == ["transformer.h.0", "transformer.h.1"]
    c_attn = calls(cap, aten.addmm.default, "h.0.attn.c_attn")
    assert [n.meta["autopar_tensor"] for n in c_attn] == [f32(16, 96)]
    (head,) = calls(cap, aten.linear.default, "lm_head")
    assert head.meta["autopar_tensor"] == f32(2, 8, 128) and head.meta["autopar_layer"] is None
    (loss,) = calls(cap, aten.cross_entropy_loss.default)
    assert loss.meta["autopar_tensor"] == f32()


def test_llama_grouped_query_attention_shapes():  # hidden 32, 4 heads, 2 KV heads: kv width 16
    _, cap = captured("llama")
    assert cap.parameters["model.layers.0.self_attn.k_proj.weight"] == f32(16, 32)
    assert cap.parameters["model.layers.0.self_attn.q_proj.weight"] == f32(32, 32)
    (k,) = calls(cap, aten.linear.default, "model.layers.1.self_attn.k_proj")
    assert k.meta["autopar_tensor"] == f32(2, 8, 16) and k.meta["autopar_layer"] == "model.layers.1"
    (q,) = calls(cap, aten.linear.default, "model.layers.1.self_attn.q_proj")
    assert q.meta["autopar_tensor"] == f32(2, 8, 32)
    assert len(calls(cap, aten.scaled_dot_product_attention.default, "self_attn")) == 2


def test_bert_vit_resnet_mlp_shapes():
    _, bert = captured("bert")
    (dec,) = calls(bert, aten.linear.default, "cls.predictions.decoder")
    assert dec.meta["autopar_tensor"] == f32(2, 8, 128)

    _, vit = captured("vit")  # 16×16 images in 4×4 patches: 16 patches + [CLS]
    (patch,) = calls(vit, aten.conv2d.default)
    assert patch.meta["autopar_tensor"] == f32(2, 32, 4, 4)
    assert f32(2, 17, 32) in [n.meta["autopar_tensor"] for n in calls(vit, aten.cat.default)]
    (cls,) = calls(vit, aten.linear.default, "classifier")
    assert cls.meta["autopar_tensor"] == f32(2, 10)

    _, res = captured("resnet")  # 32×32 → stem /2 → pool /2 → stage 1 /2
    convs = calls(res, aten.conv2d.default)
    assert convs[0].meta["autopar_tensor"] == f32(2, 16, 16, 16)
    assert convs[-1].meta["autopar_tensor"] == f32(2, 32, 4, 4)
    bn = calls(res, aten._native_batch_norm_legit_functional.default)[0]
    assert bn.meta["autopar_tensor"] == (f32(2, 16, 16, 16),) + (f32(16),) * 4  # multi-output
    (pool,) = calls(res, aten.adaptive_avg_pool2d.default)
    assert pool.meta["autopar_tensor"] == f32(2, 32, 1, 1)

    _, mlp = captured("mlp")
    lin = calls(mlp, aten.linear.default)
    assert [(n.meta["autopar_module"], n.meta["autopar_tensor"]) for n in lin] == [
        ("fc1", f32(4, 32)), ("fc2", f32(4, 8))]
    assert [o.kind for o in mlp.outputs] == ["user_output"]


def test_moe_shapes_and_loss_output():  # G=2 groups, S=8, E=4 experts, k=2: C=ceil(2·8·1.25/4)=5
    model, cap = captured("moe")
    assert model.blocks[0].moe.capacity(8) == 5
    (topk,) = calls(cap, aten.topk.default, "blocks.0.moe")
    assert topk.meta["autopar_tensor"] == (f32(2, 8, 2), TensorMeta((2, 8, 2), torch.int64))
    shapes = {n.meta["autopar_tensor"] for n in cap.nodes_in_layer("blocks.1")}
    assert f32(2, 8, 4, 5) in shapes  # dispatch / combine
    assert f32(4, 2, 5, 16) in shapes  # expert inputs [E, G, C, M]
    assert [o.kind for o in cap.outputs] == ["loss"]


def test_resnet_batchnorm_running_stats_are_buffer_mutations():
    model, cap = captured("resnet")
    mutated = [o.name for o in cap.outputs if o.kind == "buffer_mutation"]
    buffers = dict(model.named_buffers())
    assert mutated and all(name in buffers for name in mutated)
    assert "resnet.embedder.embedder.normalization.running_mean" in mutated
    assert [o.kind for o in cap.outputs if o.kind != "buffer_mutation"] == ["loss", "user_output"]


def test_distinct_ops_names_aten_ops():
    _, cap = captured("llama")
    ops = distinct_ops(cap)
    assert "aten.linear.default" in ops and "aten.scaled_dot_product_attention.default" in ops
    assert all(op.startswith("aten.") for op in ops)
    assert "aten._assert_tensor_metadata.default" not in ops


# ----------------------------------------------------------------------------- meta device


def test_meta_model_and_meta_inputs_capture():
    model, (args, kwargs) = zoo.llama(layers=3, hidden=64, heads=8, kv_heads=2, ffn=128,
                                      device="meta")
    assert all(p.is_meta for p in model.parameters()) and args[0].is_meta
    cap = capture(model, args, kwargs=kwargs)
    assert cap.layers == ("model.layers.0", "model.layers.1", "model.layers.2")
    assert cap.parameters["model.layers.2.self_attn.v_proj.weight"] == f32(16, 64)
    assert cap.num_parameters == sum(p.numel() for p in model.parameters())
    (loss,) = [o for o in cap.outputs if o.kind == "loss"]
    assert loss.meta == f32()


# ----------------------------------------------------------------------------- errors


class _BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


class _SizeFromValue(nn.Module):
    def forward(self, x):
        return x[: int(x.max().item())]


class _MaskSelect(nn.Module):
    def forward(self, x):
        return x[x > 0] * 2


@pytest.mark.parametrize("module", [_BranchOnValue(), _SizeFromValue()])
def test_data_dependent_control_flow_raises_capture_error(module):
    with pytest.raises(CaptureError) as info:
        capture(module, (torch.randn(2, 4),))
    err = info.value
    assert "data-dependent" in err.reason
    assert "torch.cond" in err.hint and "shape-only" in err.hint
    assert isinstance(err.__cause__, RuntimeError)  # chained, not swallowed
    assert "Traceback" not in str(err)


def test_branch_error_names_the_users_line():
    with pytest.raises(CaptureError) as info:
        capture(_BranchOnValue(), (torch.randn(2, 4),))
    assert "if x.sum() > 0" in info.value.reason


def test_data_dependent_shape_raises_capture_error():
    with pytest.raises(CaptureError) as info:
        capture(_MaskSelect(), (torch.randn(2, 4),))
    assert "data-dependent shape" in str(info.value) and "torch.where" in info.value.hint


class _Opaque:
    pass


@pytest.mark.parametrize("model, inputs, kwargs, needle", [
    (zoo.MLP(4, 8, 2), torch.randn(2, 4), None, "(x,)"),
    (zoo.MLP(4, 8, 2), 3, None, "tuple of positional"),
    (zoo.MLP(4, 8, 2), (torch.randn(2, 4), _Opaque()), None, "_Opaque"),
    (zoo.MLP(4, 8, 2), (torch.randn(2, 4),), ["labels"], "dict"),
    (lambda x: x, (torch.randn(2, 4),), None, "nn.Module"),
])
def test_wrong_inputs_raise_capture_error(model, inputs, kwargs, needle):
    with pytest.raises(CaptureError) as info:
        capture(model, inputs, kwargs=kwargs)
    assert needle in str(info.value)


def test_moe_rejects_bad_top_k():
    with pytest.raises(ZooError, match="top_k"):
        zoo.moe(experts=2, top_k=3)


@pytest.mark.parametrize("path, fqn", [
    ("model.layers.17.mlp", "model.layers.17.mlp"),
    ("L['self'].model.layers[17].mlp", "model.layers.17.mlp"),
    ("L['self']", ""),
    ("L['self'].blocks['3'].moe", "blocks.3.moe"),
])
def test_plain_fqn(path, fqn):
    assert plain_fqn(path) == fqn


# ----------------------------------------------------------------------------- the MoE layer itself


def _moe_reference(layer: zoo.MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token GShard routing: all first choices in token order, then second choices."""
    groups, tokens, _ = x.shape
    experts = layer.w_gate.shape[1]
    cap = layer.capacity(tokens)
    probs = torch.softmax(x @ layer.w_gate, dim=-1)
    gate, choice = probs.topk(layer.top_k, dim=-1)
    if layer.top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for g in range(groups):
        used = [0] * experts
        for j in range(layer.top_k):
            for s in range(tokens):
                e = int(choice[g, s, j])
                if used[e] < cap:
                    used[e] += 1
                    h = torch.nn.functional.gelu(x[g, s] @ layer.w_in[e])
                    y[g, s] += gate[g, s, j] * (h @ layer.w_out[e])
    return y


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 4.0), (2, 4.0), (2, 0.5), (1, 0.5)])
def test_moe_layer_matches_token_loop(top_k, capacity_factor):
    torch.manual_seed(0)
    layer = zoo.MoELayer(8, 16, 4, top_k=top_k, capacity_factor=capacity_factor).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    y, aux = layer(x)
    torch.testing.assert_close(y, _moe_reference(layer, x))
    assert aux.ndim == 0 and math.isfinite(float(aux.detach()))
    if capacity_factor < 1:  # some tokens were dropped, so the test exercised capacity
        assert (y.abs().sum(-1) == 0).any()
