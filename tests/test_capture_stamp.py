"""Layer stamping gives the full trace's graph, node for node and bit for bit, or falls back."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.fx.node import map_arg

from autopar import zoo
from autopar.passes.capture import capture
from autopar.passes.capture.stamp import TRACED
from autopar.passes.capture.trace import trace
from models import Residual

FakeTensor = torch._subclasses.FakeTensor


def assert_same_graph(a, b) -> None:
    """``a`` and ``b`` are the same graph up to node names: ops, argument structure, meta,
    inputs, outputs, layers and ties."""
    na, nb = list(a.graph_module.graph.nodes), list(b.graph_module.graph.nodes)
    assert len(na) == len(nb)
    twin: dict[str, str] = {}
    for x, y in zip(na, nb):
        assert (x.op, x.target) == (y.op, y.target), (x.format_node(), y.format_node())
        ax = map_arg((x.args, x.kwargs), lambda n: twin[n.name])
        by = map_arg((y.args, y.kwargs), lambda n: n.name)
        assert ax == by, (x.format_node(), y.format_node())
        twin[x.name] = y.name
        for key in ("autopar_tensor", "autopar_module", "autopar_layer"):
            assert x.meta[key] == y.meta[key], (key, x.name, y.name)
        if x.op != "output":
            vx, vy = x.meta.get("val"), y.meta.get("val")
            if isinstance(vy, torch.Tensor):
                assert type(vx) is FakeTensor and vx.fake_mode is not None
                assert (vx.shape, vx.stride(), vx.dtype, vx.requires_grad) == \
                       (vy.shape, vy.stride(), vy.dtype, vy.requires_grad), x.name
            paths = [p for p, _ in (x.meta.get("nn_module_stack") or {}).values()]
            assert paths == [p for p, _ in (y.meta.get("nn_module_stack") or {}).values()]
    rows = lambda cap, rename: [(i.kind, i.name, rename(i.node), i.meta) for i in cap.inputs]
    assert rows(a, twin.__getitem__) == rows(b, str)
    outs = lambda cap, rename: [(o.kind, o.name, rename(o.node), o.meta) for o in cap.outputs]
    assert outs(a, twin.get) == outs(b, lambda n: n)
    assert (a.layers, dict(a.tied), dict(a.parameters), dict(a.buffers)) == \
           (b.layers, dict(b.tied), dict(b.parameters), dict(b.buffers))
    vals = [n.meta["val"] for n in na if isinstance(n.meta.get("val"), torch.Tensor)]
    assert len({id(v) for v in vals}) == len(vals)  # every node has a fake tensor of its own


def run_graph(cap, model, args, kwargs):
    """The captured graph run on the model's real weights and the example inputs."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    values = [state[i.name] if i.kind in ("parameter", "buffer") else bound[i.name]
              for i in cap.inputs]
    with torch.no_grad():
        return torch.utils._pytree.tree_leaves(cap.graph_module(*values))


def both(model, args, kwargs=None):
    kwargs = kwargs or {}
    return (capture(model, args, kwargs=kwargs),
            capture(model, args, kwargs=kwargs, stamp_layers=False))


class Stack(nn.Module):
    """Five blocks; ``mode`` says how forward reaches them."""

    def __init__(self, mode: str, scales=(1.0,) * 5):
        super().__init__()
        self.mode = mode
        self.layers = nn.ModuleList(Residual(scale=s) for s in scales)

    def forward(self, x):
        if self.mode == "loop":
            for layer in self.layers:
                x = layer(x)
        elif self.mode == "index":  # explicit layers, beyond the traced ones
            x = self.layers[3](self.layers[0](x))
        elif self.mode == "first_three":  # only the first three of five layers run
            for i in range(3):
                x = self.layers[i](x)
        elif self.mode == "break":  # stops after two layers
            for i, layer in enumerate(self.layers):
                if i == 2:
                    break
                x = layer(x)
        elif self.mode == "collect":  # every layer's output is a graph output
            outs = []
            for layer in self.layers:
                x = layer(x)
                outs.append(x)
            return outs
        return x


# ----------------------------------------------------------------------------- models that stamp


ZOO = {
    "gpt2": ("transformer.h", lambda: zoo.gpt2(layers=5)),
    "llama": ("model.layers", lambda: zoo.llama(layers=6)),
    "bert": ("bert.encoder.layer", lambda: zoo.bert(layers=5)),
    "vit": ("vit.layers", lambda: zoo.vit(layers=5)),
    "moe": ("blocks", lambda: zoo.moe(layers=5)),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_stamped_zoo_model_equals_full_trace(name):
    container, build = ZOO[name]
    model, (args, kwargs) = build()
    stamped, full = both(model, args, kwargs)
    assert stamped.stamped == (container,) and full.stamped == ()
    assert_same_graph(stamped, full)
    for x, y in zip(run_graph(stamped, model, args, kwargs), run_graph(full, model, args, kwargs)):
        assert torch.equal(x, y)
    # the traced program behind it has the first TRACED layers only
    traced = {n.meta.get("nn_module_stack", {}).get(f"L__self__{container}.{TRACED}")
              for n in stamped.exported_program.graph.nodes}
    assert traced == {None}


def test_sequential_root_container_stamps():
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual() for _ in range(6)])
    x = torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == ("",) and stamped.layers == tuple(str(i) for i in range(6))
    assert_same_graph(stamped, full)
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))


def test_meta_llama_stamps_with_shapes_and_parameters():
    model, (args, kwargs) = zoo.llama(layers=5, hidden=64, heads=8, kv_heads=2, ffn=128,
                                      device="meta")
    stamped, full = both(model, args, kwargs)
    assert stamped.stamped == ("model.layers",)
    assert_same_graph(stamped, full)
    assert stamped.parameters["model.layers.4.self_attn.v_proj.weight"].shape == (16, 64)
    names = [n.name for n in stamped.graph_module.graph.nodes if n.op == "placeholder"]
    assert "p_model_layers_4_mlp_up_proj_weight" in names
    assert [i.name for i in stamped.inputs if i.kind == "parameter"] == \
           [fqn for fqn, _ in model.named_parameters()]


# ----------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("mode, ran", [
    ("loop", 5), ("index", 2), ("first_three", 3), ("break", 2), ("collect", 5)])
def test_forward_that_does_not_iterate_all_layers_falls_back(mode, ran):
    torch.manual_seed(0)
    model = Stack(mode)
    x = torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == (("layers",) if mode == "loop" else ())
    assert_same_graph(stamped, full)
    linears = [n for n in stamped.graph_module.graph.nodes
               if n.target is torch.ops.aten.linear.default]
    assert len(linears) == ran
    got = run_graph(stamped, model, (x,), {})
    want = model(x)
    for g, w in zip(got, want if isinstance(want, list) else [want]):
        assert torch.equal(g, w)
    # the container is whole again, also after a refused trace
    assert type(model.layers) is nn.ModuleList and len(model.layers) == 5


def test_layers_differing_in_an_attribute_fall_back():
    model = Stack("loop", scales=(1.0, 1.0, 1.0, 1.0, 0.5))  # the last layer is scaled
    x = torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == ()
    assert_same_graph(stamped, full)
    muls = [n.args[1] for n in stamped.graph_module.graph.nodes
            if n.target is torch.ops.aten.mul.Tensor and not isinstance(n.args[1], torch.fx.Node)]
    assert muls == [1.0, 1.0, 1.0, 1.0, 0.5]


def test_untraceable_truncation_restores_the_model_and_traces_in_full():
    class Fixed(Stack):
        def forward(self, x):
            assert len(self.layers) == 5, "forward insists on five layers"
            for layer in self.layers:
                x = layer(x)
            return x

    model = Fixed("loop")
    stamped, full = both(model, (torch.randn(4, 8),))
    assert stamped.stamped == () and len(model.layers) == 5
    assert_same_graph(stamped, full)


def test_two_containers_both_stamp():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList(Residual() for _ in range(5))
            self.mid = nn.Linear(8, 8)
            self.dec = nn.Sequential(*[Residual() for _ in range(4)])

        def forward(self, x):
            for layer in self.enc:
                x = layer(x)
            return self.dec(self.mid(x)).sum()

    torch.manual_seed(0)
    model, x = Two(), torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == ("enc", "dec") and len(stamped.layers) == 9
    assert_same_graph(stamped, full)
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))


class Handing(nn.Module):
    """A layer that hands part of its input on to the next layer (Zaya's router state): the last
    layer's is dead, and export drops it."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x, state):
        h = self.proj(x) + state.sum(-1, keepdim=True)
        return x + torch.tanh(h), x[:, :2].clone()


class HandingStack(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(Handing() for _ in range(n))

    def forward(self, x):
        state, total = x[:, :2] * 0, x.new_zeros(())
        for layer in self.layers:
            x, state = layer(x, state)
            total = total + x.mean()  # a running sum, read after the last layer
        return x.sum() + total


@pytest.mark.parametrize("n", [4, 5, 7])
def test_a_layer_handing_state_to_the_next_stamps_with_a_spare_unit_as_the_last(n):
    """Three traced layers differ (the last one's handed-on state, dead, is dropped by export):
    a fourth is traced and becomes the model's last, the layers between copies of a middle one.
    Four layers leave nothing to copy: traced whole."""
    torch.manual_seed(0)
    model, x = HandingStack(n), torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == (("layers",) if n > TRACED + 1 else ())
    assert_same_graph(stamped, full)
    clones = [n.meta["autopar_layer"] for n in stamped.graph_module.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert clones == [f"layers.{i}" for i in range(n - 1)]
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))


class Typed(nn.Module):
    """Layers alike whose kind only the config's per-layer list says, looked up by the loop's
    index as HF's ``config.layer_types[i]``."""

    def __init__(self, types: str):
        super().__init__()
        self.config = TypesConfig(list(types))
        self.layers = nn.ModuleList(Residual() for _ in types)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) * (0.5 if self.config.layer_types[i] == "s" else 2.0)
        return x.sum()


class TypesConfig:
    """A config holding one per-layer list, as HF's do."""

    def __init__(self, layer_types: list[str]):
        self.layer_types = layer_types


@pytest.mark.parametrize("types, stamps", [
    ("f" + "sssf" * 6 + "ssf", True),  # Flint's shape: a prefix, units of 4, the last a layer short
    ("sssf" * 6 + "f", True),  # a last layer unlike the units
    ("sf" * 6 + "ss", True),  # a tail of 2 after units of 2
    ("sssf" * 3 + "ssf", False),  # a tail needs 5 units (traced with a spare one)
])
def test_a_tail_after_the_last_unit_is_traced_with_a_spare_unit(types, stamps):
    torch.manual_seed(0)
    model, x = Typed(types), torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == (("layers",) if stamps else ())
    assert_same_graph(stamped, full)
    kinds = [n.args[1] for n in stamped.graph_module.graph.nodes  # not the layers' own scale (1.0)
             if n.target is torch.ops.aten.mul.Tensor and n.args[1] in (0.5, 2.0)]
    assert kinds == [0.5 if t == "s" else 2.0 for t in types]
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))
    assert model.config.layer_types == list(types)  # restored after the cut trace


class Buffered(Residual):
    """A residual layer with a buffer and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.ones(8))
        self.register_buffer("shift", torch.zeros(8), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.gain + self.shift


@pytest.mark.parametrize("reach, traces", [("index", 2), ("length", 2), ("skip", 1)])
def test_a_container_forward_does_not_iterate_is_traced_whole_and_the_others_stamp(reach, traces, monkeypatch):
    """One container read by index (or whose length forward takes) does not stop another from
    stamping: the model is traced again without it. One forward never touches keeps the first
    trace, its cut layers' parameters added as the full trace has them."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList(Buffered() for _ in range(5))
            self.side = nn.ModuleList(Buffered() for _ in range(5))

        def forward(self, x):
            for layer in self.enc:
                x = layer(x)
            return (self.side[1](x) if reach == "index" else x * len(self.side) if reach == "length" else x).sum()

    import autopar.passes.capture as capturing

    calls = []
    monkeypatch.setattr(capturing, "trace", lambda *a: calls.append(1) or trace(*a))
    torch.manual_seed(0)
    model, x = Two(), torch.randn(4, 8)
    stamped = capture(model, (x,))
    assert len(calls) == traces
    full = capture(model, (x,), stamp_layers=False)
    assert stamped.stamped == (("enc",) if traces == 2 else ("enc", "side"))
    assert_same_graph(stamped, full)
    assert [i.frozen for i in stamped.inputs] == [i.frozen for i in full.inputs]
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))


# ----------------------------------------------------------------------------- stacks that repeat with a period


class Gated(nn.Module):
    """Another kind of layer than :class:`Residual`: a gate and two weights."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.gate, self.up = nn.Linear(width, width), nn.Linear(width, width, bias=False)

    def forward(self, x):
        return x + torch.sigmoid(self.gate(x)) * self.up(x)


@pytest.mark.parametrize("kinds, period", [
    ("rrg" * 4, 3),  # two kinds of layers, a hybrid of period 3
    ("rg" * 5, 2),
])
def test_a_hybrid_stack_that_repeats_stamps_by_its_period(kinds, period):
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual() if k == "r" else Gated() for k in kinds])
    x = torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == ("",) and stamped.layers == tuple(str(i) for i in range(len(kinds)))
    assert_same_graph(stamped, full)
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))
    linears = lambda graph: sum(n.target is torch.ops.aten.linear.default for n in graph.nodes)
    assert linears(stamped.exported_program.graph) == linears(full.graph_module.graph) * TRACED * period // len(kinds)


def test_an_attribute_that_repeats_with_a_period_stamps_and_one_that_does_not_falls_back():
    x = torch.randn(4, 8)
    for scales, stamps in [((1.0, 0.5) * 4, True), ((1.0, 0.5) * 3 + (1.0, 1.0), False)]:
        torch.manual_seed(0)
        model = Stack("loop", scales=scales)
        stamped, full = both(model, (x,))
        assert stamped.stamped == (("layers",) if stamps else ())
        assert_same_graph(stamped, full)
        muls = [n.args[1] for n in stamped.graph_module.graph.nodes
                if n.target is torch.ops.aten.mul.Tensor and not isinstance(n.args[1], torch.fx.Node)]
        assert muls == list(scales)


def test_an_index_counting_up_by_two_per_layer_is_a_counter():
    """Beam's layers number their residual slots 2i and 2i+1: a counter with a step of 2, not a
    difference (what it indexes, the segments' isomorphism checks)."""
    torch.manual_seed(0)
    layers = [Residual() if i % 2 else Gated() for i in range(8)]
    for i, layer in enumerate(layers):
        layer.slot = 2 * i
    model, x = nn.Sequential(*layers), torch.randn(4, 8)
    stamped, full = both(model, (x,))
    assert stamped.stamped == ("",)
    assert_same_graph(stamped, full)
    (y,) = run_graph(stamped, model, (x,), {})
    assert torch.equal(y, model(x))


def test_a_stack_with_a_prefix_stamps_after_it_and_a_long_prefix_falls_back():
    """Period 2 after one odd layer: the odd layer is traced as it is and the units after it
    stamped. A prefix over a quarter of the stack is not looked for: traced whole."""
    x = torch.randn(4, 8)
    for odd, stamps in [(1, True), (3, False)]:
        torch.manual_seed(0)
        model = nn.Sequential(*[Gated() for _ in range(odd)] + [Residual() if i % 2 else Gated() for i in range(8)])
        stamped, full = both(model, (x,))
        assert stamped.stamped == (("",) if stamps else ())
        assert_same_graph(stamped, full)
        (y,) = run_graph(stamped, model, (x,), {})
        assert torch.equal(y, model(x))
    linears = lambda graph: sum(n.target is torch.ops.aten.linear.default for n in graph.nodes)
    model = nn.Sequential(*[Gated()] + [Residual() if i % 2 else Gated() for i in range(8)])
    stamped, _ = both(model, (x,))
    assert linears(stamped.exported_program.graph) == 2 + 2 * TRACED + TRACED  # the prefix and 3 units traced


transformers = pytest.importorskip("transformers")


def _stamped_and_full(name, layers, **sizes):
    """``name`` tiny with ``layers`` layers and ``sizes``: its stamped capture equals the full
    trace, node for node and in its results."""
    from autopar.zoo_hf import architectures, build, config_of

    arch = next(a for a in architectures() if a.class_name == name)
    config = config_of(arch)
    config.num_hidden_layers = layers
    for key, value in sizes.items():
        setattr(config, key, value)
    model, inputs = build(arch, config=config, seq=8)
    stamped, full = both(model, (), inputs)
    assert stamped.stamped == ("model.layers",)
    assert_same_graph(stamped, full)
    for a, b in zip(run_graph(stamped, model, (), inputs), run_graph(full, model, (), inputs)):
        assert torch.equal(a, b)


def test_jamba_stamps_by_its_period():
    """Attention every 2nd layer, experts every 2nd (offset by one): a period of 2 layers."""
    _stamped_and_full("JambaForCausalLM", 8, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=0)


def test_glm4_moe_stamps_after_its_dense_layers():
    """Its first ``first_k_dense_replace`` layers have a dense MLP, the rest routed experts."""
    _stamped_and_full("Glm4MoeForCausalLM", 10, first_k_dense_replace=2)


@pytest.mark.slow
def test_deepseek_v4_stamps_with_its_layers_rotary_buffers_in_the_order_export_lists_them():
    """Three hash-routed layers, then compressed and sparse attention in turn (period 2). Export
    lists a layer's non-persistent rotary buffers otherwise than the model does (the indexer's
    first): the order is checked from layer to layer only."""
    types = ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 5
    _stamped_and_full("DeepseekV4ForCausalLM", len(types), layer_types=types,
                      mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 10)


@pytest.mark.slow
def test_qwen3_next_stamps_by_its_period():
    """Three linear-attention layers, then one attention layer: 16 layers in 4 units."""
    _stamped_and_full("Qwen3NextForCausalLM", 16, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 4)


@pytest.mark.slow
def test_zamba_stamps_after_its_prefix_with_the_shared_block_tied_into_it():
    """Zamba's hybrid layers share one attention block (tied to the first hybrid layer's, in the
    prefix): every unit reads that block as a node from before the layers."""
    kinds = ["hybrid" if i in (2, 6, 9, 12, 15) else "linear_attention" for i in range(16)]  # period 3 after 4
    _stamped_and_full("ZambaForCausalLM", 16, layers_block_type=kinds)


@pytest.mark.slow
def test_zaya_stamps_although_export_drops_the_last_layers_router_state():
    """Each layer hands its router state to the next; the last layer's is dead and dropped."""
    _stamped_and_full("ZayaForCausalLM", 6, layer_types=["hybrid"] * 6)


@pytest.mark.slow
def test_flint_stamps_with_its_tail_and_its_per_layer_types_cut():
    """Two full-attention layers, units of three sliding and one full, the last unit a layer
    short; forward looks each layer's mask up by its index in ``config.layer_types``."""
    types = ["full_attention"] * 2 + ["sliding_attention"] * 3 + ["full_attention"]
    types = types[:2] + types[2:] * 5 + ["sliding_attention"] * 2 + ["full_attention"]
    _stamped_and_full("FlintForCausalLM", len(types), layer_types=types, mlp_only_layers=[0, 1])
