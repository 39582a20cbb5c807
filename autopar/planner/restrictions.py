"""Restrictions of the strategy space: the filters that turn the planner's ILP into a named
parallelism (data parallel, FSDP/ZeRO-3, Megatron's ``(dp, tp)``). ``allow(graph, i, strategy)``
says whether node ``i`` of a cost graph may take ``strategy``.
"""

from __future__ import annotations

from autopar.core.placement import Replicate, Shard


def _param_inputs(graph) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for e in graph.edges:
        if graph.nodes[e.src].kind == "parameter":
            out.setdefault(e.dst, set()).add(e.in_index)
    return out


def _rule(*, batch_axes, zero_axes, param_replicated_axes, whole_batch_axes=frozenset()):
    """A strategy filter: inputs batch-split on ``batch_axes`` and whole elsewhere, and no op
    working on the batch computes redundantly there; parameters
    stored sharded on ``zero_axes`` (replicated elsewhere among ``param_replicated_axes``) and
    consumed whole on ``param_replicated_axes``; on ``whole_batch_axes`` no activation is split
    on its dim 0 (the batch, or batch×sequence, in every model we know)."""
    held: list = []  # [the graph, its parameter inputs per node, verdicts]: one graph at a time

    def allow(graph, i, strategy) -> bool:
        if not held or held[0] is not graph:
            held[:] = [graph, {n: frozenset(k) for n, k in _param_inputs(graph).items()}, {}]
        node = graph.nodes[i]
        params = held[1].get(i, frozenset())
        # repeated layers share their strategy objects: a verdict depends on the strategy and on
        # these facts of the node only
        key = (id(strategy), node.kind, node.batch_dependent, params)
        verdict = held[2].get(key)
        if verdict is None:
            verdict = held[2][key] = _allowed(node, strategy, params)
        return verdict

    def _allowed(node, strategy, params) -> bool:
        if node.kind == "user_input":
            (sh,) = strategy.outputs
            return all(isinstance(sh[a], Shard) and sh[a].dim == 0 if a in batch_axes
                       else isinstance(sh[a], Replicate) for a in range(len(sh)))
        if node.kind == "parameter":
            (sh,) = strategy.outputs
            for a in param_replicated_axes:
                want_shard = a in zero_axes
                if want_shard != isinstance(sh[a], Shard):
                    return False
            return True
        if node.kind == "op":
            if node.batch_dependent and any(strategy.replicated_on(a) for a in batch_axes):
                return False  # data parallelism: every rank works on its own part of the batch
            for k in params:
                if not all(isinstance(strategy.inputs[k][a], Replicate) for a in param_replicated_axes):
                    return False
            activations = [s for k, s in enumerate(strategy.inputs) if k not in params] + list(strategy.outputs)
            for a in whole_batch_axes:
                if any(s[a] == Shard(0) for s in activations):
                    return False
        return True

    return allow


def _sharded_axes(mesh_shape) -> set[int]:
    return {a for a, n in enumerate(mesh_shape) if n > 1}


def data_rule(mesh_shape):
    """The strategy filter of data parallelism over every mesh axis."""
    axes = _sharded_axes(mesh_shape)
    return _rule(batch_axes=axes, zero_axes=set(), param_replicated_axes=set(range(len(mesh_shape))))


def fsdp_rule(mesh_shape):
    """The strategy filter of ZeRO-3 over every mesh axis."""
    axes = _sharded_axes(mesh_shape)
    return _rule(batch_axes=axes, zero_axes=axes, param_replicated_axes=set(range(len(mesh_shape))))


def megatron_rule(mesh_shape, *, zero: int):
    """The strategy filter of a ``(dp, tp)`` Megatron configuration."""
    dp_axes = {0} if mesh_shape[0] > 1 else set()
    return _rule(batch_axes=dp_axes, zero_axes=dp_axes if zero >= 3 else set(), param_replicated_axes={0},
                 whole_batch_axes={1})


def megatron_tp_rule():
    """The Megatron filter on a stage's tensor-parallel axis alone (mesh axis 0 of a 1-D tp
    mesh): inputs whole, no activation split on its dim 0, any parameter split."""
    return _rule(batch_axes=set(), zero_axes=set(), param_replicated_axes=set(), whole_batch_axes={0})


__all__ = ["data_rule", "fsdp_rule", "megatron_rule", "megatron_tp_rule"]
