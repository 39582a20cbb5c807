"""The rule registry as a whole: every registered op's every strategy passes the checker on
1-, 2- and 3-axis meshes, and every op of the seven example models has a rule."""

import warnings

import pytest
import torch

from autopar import UnsupportedOpWarning, zoo
from autopar.passes.capture import capture
from autopar.passes.rules import coverage, registered_ops, spec_of_node, strategies
from autopar.passes.rules.check import check_op, main
from autopar.passes.rules.derived import derived_entry, pointwise_ops
from autopar.passes.rules.registry import entry, explicit_entry

aten = torch.ops.aten
# Factories whose plain op cannot produce a shard (arange, full, ...): replicated only, by design.
REPLICATED_ONLY = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
    aten.zeros.default, aten.ones.default, aten.scalar_tensor.default,
}


# composite ops whose decomposition is elementwise: derived from it, not from a tag
COMPOSITE_ELEMENTWISE = [aten.type_as.default, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar]


@pytest.mark.parametrize("op", registered_ops() + list(pointwise_ops()) + COMPOSITE_ELEMENTWISE, ids=str)
def test_every_strategy_of_every_registered_op_matches_the_unsharded_op(op):
    rep = check_op(op)
    assert rep.failures == []
    assert rep.checked > 0
    if op not in REPLICATED_ONLY:
        assert rep.sharded_strategies > 0, f"{op} offers no sharded strategy on its samples"


def test_every_pointwise_overload_has_a_rule_and_only_elementwise_ones_are_derived():
    tagged = list(pointwise_ops())
    assert aten.min.other in tagged and aten.fmod.Scalar in tagged and aten.bitwise_xor.Tensor in tagged
    assert all(entry(op) is not None and explicit_entry(op) is None for op in tagged + COMPOSITE_ELEMENTWISE)
    assert derived_entry(aten.add.Tensor) is not None and entry(aten.add.Tensor) is explicit_entry(aten.add.Tensor)
    not_elementwise = [aten.add_.Tensor, aten.bernoulli.p, aten.repeat_interleave.self_int, aten.expand_as.default,
                       aten.sum.default, aten.nonzero.default]
    assert [op for op in not_elementwise if derived_entry(op) is not None] == []


def test_every_registered_op_has_samples_for_the_checker():
    assert [str(op) for op in registered_ops() if entry(op).samples is None] == []


def test_checker_cli_checks_one_op_and_rejects_unknown_ones(capsys):
    assert main(["--op", "aten.broadcast_tensors.default"]) == 0
    assert "1 ops" in capsys.readouterr().out
    assert main(["--op", "aten.not_an_op.default"]) == 2


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "resnet", "mlp", "moe"])
def test_every_op_of_the_example_models_has_a_rule_and_plans_without_warnings(name):
    model, (args, kwargs) = getattr(zoo, name)()
    captured = capture(model, args, kwargs=kwargs)
    cov = coverage(captured.graph_module)
    assert cov and all(cov.values()), [op for op, ok in cov.items() if not ok]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedOpWarning)
        sharded = 0
        for node in captured.graph_module.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                strats = strategies(spec_of_node(node), (2, 2))
                sharded += len(strats) > 1
    assert sharded > 0
