"""RWKV's WKV loop captured as one node (passes/capture/wkv.py): the graph no longer grows with
the sequence, its costs are counted from pieces exactly as from the whole loop, and plans that
shard it train like one process. (That its numbers are the model's: tests/test_scan.py.)"""

from __future__ import annotations

import pytest
import torch

import autopar.cost_models.compute as compute
from autopar.core.ir import spec_of_call
from autopar.passes.capture.wkv import wkv

pytest.importorskip("transformers")

from autopar.passes.capture import capture  # noqa: E402
from autopar.zoo_hf import architectures, build  # noqa: E402


def _rwkv(**kwargs):
    return build(next(a for a in architectures() if a.class_name == "RwkvForCausalLM"), **kwargs)


def test_an_rwkv_graph_does_not_grow_with_the_sequence():
    sizes = []
    for seq in (16, 64):
        model, inputs = _rwkv(seq=seq, device="meta")
        graph = capture(model, (), kwargs=inputs).graph_module.graph
        assert sum(n.target == torch.ops.autopar.wkv.default for n in graph.nodes) == model.config.num_hidden_layers
        sizes.append(len(graph.nodes))
    assert sizes[0] == sizes[1]


def test_a_state_carried_in_or_out_runs_the_models_own_loop():
    """Generation (``use_cache``): the state goes out of the prompt and into the next token."""
    from autopar.passes.capture.scan import parallel_scans

    model, inputs = _rwkv(seq=12)
    model.eval()
    ids = inputs["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True)
        want_next = model(input_ids=ids[:, :1], state=want.state, use_cache=True)
        with parallel_scans(model):
            got = model(input_ids=ids, use_cache=True)
            got_next = model(input_ids=ids[:, :1], state=got.state, use_cache=True)
    assert torch.equal(got.logits, want.logits) and torch.equal(got_next.logits, want_next.logits)


@pytest.mark.parametrize("shape, dtype", [((3, 50, 6), torch.float32), ((1, 20, 4), torch.bfloat16),
                                          ((5, 7, 1), torch.float32), ((4, 2, 5), torch.bfloat16)])
def test_the_costs_counted_from_pieces_equal_those_of_the_whole_loop(shape, dtype, monkeypatch):
    meta = lambda *s, dtype=torch.float32: torch.empty(*s, device="meta", dtype=dtype)
    args = (meta(shape[2]), meta(shape[2]), meta(*shape, dtype=dtype), meta(*shape, dtype=dtype))
    spec = spec_of_call(torch.ops.autopar.wkv.default, args, {}, wkv(*args))

    def counts():
        compute._FLOPS_CACHE.clear()
        compute._COMPOSITE_CACHE.clear()
        return (compute.node_flops(spec), compute.node_bytes(spec), compute._composite(spec)[2],
                compute._composite(spec, backward=True)[2])

    pieces = counts()
    monkeypatch.delitem(compute.COMPOSITE_UNITS, "wkv")
    whole = counts()
    assert pieces == whole and whole[0][1] > whole[0][0] > 0
    compute._FLOPS_CACHE.clear()
    compute._COMPOSITE_CACHE.clear()


@pytest.mark.slow
def test_plans_that_shard_the_wkv_train_like_one_process():
    """FSDP shards its batch; all three plans match one process."""
    from one_process import sharded_op_mismatches

    model, inputs = _rwkv(batch=4, seq=16)
    wrong = sharded_op_mismatches(model, inputs, "autopar.wkv.default", sharding=("fsdp",))
    assert {name: why for name, why in wrong.items() if why} == {}
