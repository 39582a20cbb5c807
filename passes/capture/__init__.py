"""Capture: a model and example inputs → an ATen FX graph with shapes, module paths and layers.

:func:`capture` checks the inputs (:mod:`~autopar.passes.capture.inputs`), traces the model with
``torch.export`` (non-strict) on fake tensors (:mod:`~autopar.passes.capture.trace`), keeps one
placeholder per tied weight (:mod:`~autopar.passes.capture.ties`), writes shapes, module paths
and layers on every node (:mod:`~autopar.passes.capture.annotate`,
:mod:`~autopar.passes.capture.layers`), labels what may share one decision (repeated blocks,
unrolled loops: :mod:`~autopar.passes.capture.repeats`), rewrites mean losses as sum / count so
that they shard over the batch (:mod:`~autopar.passes.capture.mean_loss`), makes ``empty``
tensors zeros (:mod:`~autopar.passes.capture.empties`), records what each node's backward
saves (:mod:`~autopar.passes.capture.saved`) and names the outputs, the loss among
them (:mod:`~autopar.passes.capture.outputs`). transformers' routed experts are traced as a dense
dispatch over stacked experts (:mod:`~autopar.passes.capture.moe`), and time-step recurrences as
parallel scans (:mod:`~autopar.passes.capture.scan`). Nothing proportional to the model is allocated:
the model may live on the meta device and so may the inputs. The graph is planned in the
model's current mode (call ``model.train()`` for a training graph)::

    model, (args, kwargs) = autopar.zoo.gpt2()
    cap = capture(model, args, kwargs=kwargs)
    cap.layers            # ('transformer.h.0', 'transformer.h.1')
    cap.tied              # {'lm_head.weight': 'transformer.wte.weight'}

``cap.graph_module`` is a copy, independent of ``cap.exported_program``.

**Layer stamping** (``stamp_layers=True``, the default): a container of more than three repeated
layers is traced with its first three only and the other layers' nodes are copies of the third's
(where the last traced layer differs, or a tail follows the repeats, a fourth is traced as the
model's last; :mod:`autopar.passes.capture.stamp` says when that is exact; otherwise the model
is traced whole). The
graph, inputs, outputs and meta are those of the full trace, up to compute-node names;
``cap.stamped`` names the stamped containers. LLaMA-2-70B captures in a few seconds instead of
about a minute.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from autopar.core.errors import CaptureError
from autopar.core.ir import drop_unread_asserts
from autopar.passes.capture import stamp
from autopar.passes.capture.annotate import annotate, annotate_output, plain_fqn
from autopar.passes.capture.copies import differentiable_copies_pass
from autopar.passes.capture.empties import defined_empties_pass
from autopar.passes.capture.graph import CapturedGraph, GraphInput, GraphOutput, distinct_ops
from autopar.passes.capture.inputs import check_dtypes, check_inputs
from autopar.passes.capture.layers import order_layers, repeated_blocks, repeated_containers
from autopar.passes.capture.loss import unwrap
from autopar.passes.capture.mean_loss import mean_loss_pass
from autopar.passes.capture.moe import batch_size, traced_experts
from autopar.passes.capture.outputs import graph_outputs
from autopar.passes.capture.repeats import repeats_pass
from autopar.passes.capture.saved import saved_tensors_pass
from autopar.passes.capture.scan import parallel_scans
from autopar.passes.capture.ties import dedupe_tied, tied_fqns
from autopar.passes.capture.trace import trace

log = logging.getLogger(__name__)


def capture(model: nn.Module, example_inputs, *, kwargs: dict | None = None,
            stamp_layers: bool = True, moe_dispatch: str = "dense",
            moe_capacity_factor: float | None = None) -> CapturedGraph:
    """Trace ``model(*example_inputs, **kwargs)`` into a :class:`CapturedGraph` with fake tensors.

    ``stamp_layers``: trace the first layers of each long run of repeated layers and copy the
    rest (see :mod:`autopar.passes.capture.stamp`); the graph equals the full trace's, or the model is
    traced in full. ``False`` always traces in full.

    ``moe_dispatch``: trace transformers' routed experts as a dense dispatch over stacked experts
    (``"dense"``, :mod:`~autopar.passes.capture.moe`: expert parallelism can be planned) or as
    the model runs them (``"sorted"``); ``moe_capacity_factor``: the dense dispatch's slots per
    expert (:func:`~autopar.passes.capture.moe.capacity`; None: every token kept, as the model).

    Raises :class:`autopar.CaptureError` (with the tracer's reason and a hint) when the inputs
    are of the wrong type or the model cannot be traced.
    """
    args, kwargs = check_inputs(model, example_inputs, kwargs)
    check_dtypes(model, args, kwargs)
    tree = unwrap(model)  # where the layers are: a WithLoss's model
    ties = tied_fqns(tree)
    containers = repeated_containers(tree)
    layer_set = frozenset(c for children in containers.values() for c in children)
    frozen = frozenset(fqn for fqn, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)
    with traced_experts(tree, dispatch=moe_dispatch, groups=batch_size(args, kwargs),
                        capacity_factor=moe_capacity_factor), parallel_scans(tree):
        traced = _stamped_trace(model, tree, args, kwargs, ties, containers, layer_set, frozen) \
            if stamp_layers else None
        if traced is None:
            exported = trace(model, args, kwargs)
            graph_module, inputs = _annotated_graph(exported, ties, layer_set, frozen)
            stamped: tuple[str, ...] = ()
        else:
            exported, graph_module, inputs, stamped = traced
    unread = {n.name for n in graph_module.graph.nodes if n.op == "placeholder" and not n.users}
    inputs = [dataclasses.replace(i, frozen=True) if i.kind == "parameter" and (i.name in frozen or i.node in unread)
              else i for i in inputs]
    params = {i.name: i.meta for i in inputs if i.kind == "parameter"}
    buffers = {i.name: i.meta for i in inputs if i.kind == "buffer"}
    tied = {alias: canon for alias, canon in ties.items() if canon in params or canon in buffers}
    layers = order_layers(graph_module, layer_set, tree)
    repeats_pass(graph_module, frozenset(b for group in repeated_blocks(tree) for b in group))
    outputs = graph_outputs(exported, graph_module)
    return CapturedGraph(graph_module=graph_module, exported_program=exported,
                         inputs=tuple(inputs), outputs=tuple(outputs), parameters=params,
                         buffers=buffers, tied=tied, layers=layers, stamped=stamped,
                         moe_dispatch=moe_dispatch, moe_capacity_factor=moe_capacity_factor)


def _annotated_graph(exported, ties, layer_set, frozen):
    """The exported graph with tied placeholders merged, what no output depends on removed
    (:func:`drop_dead`), copies made differentiable, annotated, mean losses and empty tensors
    rewritten, saved tensors recorded."""
    graph_module, inputs = dedupe_tied(exported, ties)
    drop_dead(graph_module.graph)
    differentiable_copies_pass(graph_module)
    annotate(graph_module, inputs, layer_set)
    mean_loss_pass(graph_module)
    defined_empties_pass(graph_module)
    annotate_output(graph_module)
    saved_tensors_pass(graph_module, inputs, frozen)
    return graph_module, inputs


def drop_dead(graph: torch.fx.Graph) -> None:
    """Remove what no output depends on, as the program's code generation does: export keeps a
    value alive by a dtype assert alone (MRA's key and value projections, whose attention the
    model skips), which plans would otherwise price and programs never run."""
    drop_unread_asserts(graph)
    graph.eliminate_dead_code()


def _stamped_trace(model, tree, args, kwargs, ties, containers, layer_set, frozen):
    """(exported, graph module, inputs, stamped containers) by layer stamping of ``tree``'s
    containers while tracing ``model``, or ``None``. A container forward never touched keeps the
    trace, its cut children's placeholders added (:func:`stamp.add_untouched`). Traced again
    without the containers forward did not iterate over to their end (the others may stamp), or,
    where the traced units' graphs differ, with a spare unit (the model's last:
    :meth:`stamp.Stack.spare`)."""
    chosen = stamp.stampable(tree, containers, ties)
    while chosen:
        accesses: dict = {}
        stamping = False
        try:
            with stamp.truncated(tree, chosen) as accesses:
                exported = trace(model, args, kwargs)
            stamp.check_accesses(accesses)
            # mean losses are rewritten before stamping: the small graph is cheaper to recompile
            graph_module, inputs = _annotated_graph(exported, ties, layer_set, frozen)
            specs = exported.graph_signature.output_specs
            idle = stamp.untouched(accesses)
            stamping = True
            for stack in (s for p, s in chosen.items() if p not in idle):
                graph_module, inputs = stamp.stamp_container(graph_module, inputs, stack, specs)
            for path in (p for p in chosen if p in idle):
                graph_module, inputs = stamp.add_untouched(graph_module, inputs, chosen[path], tree, ties)
            stamping = False
            stamp.check_order(tree, inputs, chosen.values())
            return exported, graph_module, inputs, tuple(chosen)
        except (stamp.NotStampable, CaptureError) as exc:
            missed = stamp.unreached(accesses)
            if isinstance(exc, CaptureError):  # the trace stopped: only a refused access says why
                missed = {p: how for p, how in missed.items() if accesses[p]["refused"]}
            retry = ({p: s for p, s in chosen.items() if p not in missed} if missed
                     else stamp.with_spare_unit(chosen) if stamping else {})
            log.debug("layer stamping of %s %s: %s", sorted(chosen),
                      f"traces again, stamping {sorted(retry)}" if retry else "falls back to a full trace",
                      "; ".join(f"{p}: {how}" for p, how in missed.items()) or exc)
            chosen = retry
    return None


__all__ = ["CapturedGraph", "GraphInput", "GraphOutput", "capture", "distinct_ops", "plain_fqn"]
