"""The alternatives a pipelined plan records for its stages' nodes (for ``plan.explain``), as
:func:`autopar.planner.alternatives.node_details` records them for a one-stage plan.

A stage runs the window graph's strategies (:mod:`autopar.planner.stage_costs`) on the ``tp``
axis of its mesh ``(dp, tp)``, with the micro-batch split on ``dp``. Each alternative of a window
node is costed on the window graph with every strategy, at the stage's micro-batch (per-step
collectives weighted ``1 / B``, so ``B`` micro-batches count them once): switching the node alone,
every other node fixed, changes the stage's seconds per micro-batch by ``Δ``
(:func:`~autopar.planner.alternatives.switch_costs`), hence the pipeline latency
``(B − 1)·max stage + Σ stages`` (the plan's step time) by ``(B − 1)·(max(t_k + Δ, t_others) −
max t) + Δ``. Like the stage's own NodeChoice, an alternative's seconds are per step (``B``
micro-batches), and its Δmem counts the micro-batches the stage holds in flight. A recomputing
stage's second forward is not counted.
"""

from __future__ import annotations

from autopar.core.placement import Replicate, format_sharding
from autopar.plan import Alternative
from autopar.planner.alternatives import DEFAULT_TOP, best_alternatives, incident_edges
from autopar.planner.costgraph import build_cost_graph
from autopar.planner.costs import captured_dtype
from autopar.planner.microbatch import MicroBatchCostModel

R = Replicate()


def stage_sharding(info, node: str, strategy, dp: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Window node ``node``'s tp-axis ``strategy`` on a stage mesh ``(dp, tp)`` as (inputs,
    outputs) text: the micro-batch placement on ``dp`` (``R`` when ``dp = 1``) in front."""

    def text(mb, shardings):
        return tuple(format_sharding((p if dp > 1 else R,) + tuple(s)) for p, s in zip(mb, shardings))

    return text(info.mb_in[node], strategy.inputs), text(info.mb_out[node], strategy.outputs)


def latency_change(times, stage: int, batches: int):
    """Δ seconds per micro-batch of stage ``stage`` -> Δ pipeline latency (module docstring)."""
    slowest = max(times)
    others = max((t for k, t in enumerate(times) if k != stage), default=0.0)
    return lambda d: (batches - 1) * (max(times[stage] + d, others) - slowest) + d


class StageAlternatives:
    """Each stage's recorded alternatives; window graphs are built once per ``(tp, micro-batch,
    micro-batches)`` and shared by the stages that have them."""

    def __init__(self, model, times, *, top: int = DEFAULT_TOP):
        self.model, self.times, self.top = model, list(times), top
        self._graphs: dict = {}

    def _graph(self, tp: int, b: int, batches: int):
        key = (tp, b, batches)
        if key not in self._graphs:
            m = self.model
            cm = MicroBatchCostModel(m.tp_cluster(tp), m.options, pieces=m.batch // b, step_weight=1.0 / batches,
                                     precision=m.precision, captured_dtype=captured_dtype(m.captured))
            graph = build_cost_graph(m.info.planned(), cm, microbatch=m.info)
            self._graphs[key] = (graph, incident_edges(graph))
        return self._graphs[key]

    def of_stage(self, stage: int, cfg, *, b: int, batches: int, in_flight: int
                 ) -> dict[str, tuple[int, tuple[Alternative, ...]]]:
        """Window node -> (its number of strategies, its best alternatives) for stage ``stage``
        on ``cfg``'s mesh with ``b`` samples per replica per micro-batch."""
        graph, (out_edges, in_edges) = self._graph(cfg.tp, b, batches)
        chosen = self.model.candidates[cfg.tp][cfg.candidate].strategy_of()
        choice = [node.strategies.index(chosen[node.name]) for node in graph.nodes]
        step = latency_change(self.times, stage, batches)
        out = {}
        for i, node in enumerate(graph.nodes):
            if node.kind != "op":
                continue
            out[node.name] = (node.size, best_alternatives(
                graph, choice, i, out_edges=out_edges.get(i, ()), in_edges=in_edges.get(i, ()), top=self.top,
                text=lambda s, name=node.name: stage_sharding(self.model.info, name, s, cfg.dp),
                scale=batches, step_delta=step, memory_scale=in_flight))
        return out


__all__ = ["StageAlternatives", "latency_change", "stage_sharding"]
