"""The predicted peak memory of one training step of a one-program plan, phase by phase.

The ILP constrains a linear sum (model states plus every saved activation); the program never
holds all of that at once. Its peak is the larger of two moments (what ``verify`` measures):

- **backward**, walked node by node in reverse (:func:`backward_walk`): parameters, optimizer
  state, the inputs and the outputs the program returns besides the loss (e.g. the logits, held
  to the end), what autograd saved (``meta["autopar_saved"]``) for the nodes whose backward has
  not run yet, the parameter gradients made so far (each appears at its last consumer's
  backward) and the backward of the node in flight (``meta["autopar_backward"]``: its gradients
  and scratch, e.g. the loss's gradients of the logits, and the sharded parameters gathered for
  it, ZeRO-3);
- **the optimizer step**: parameters, gradients, optimizer state, the inputs and the outputs the
  program returns besides the loss (e.g. the logits), and the optimizer's scratch (the foreach
  Adam step's square root of the second moment: one tensor of each parameter's size).

A pipeline stage's peak is composed from walks over parts of its layers
(:mod:`autopar.planner.stage_peak`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.precision import MOMENTS
from autopar.plan import MemoryBreakdown


@dataclass(frozen=True)
class Walk:
    """One backward pass over some nodes: ``saved``, what they save (all freed by the end);
    ``made``, the parameter gradients it makes; ``peak``, ``(saved still held, gradients made so
    far, in flight)`` at its highest moment."""

    saved: float
    made: float
    peak: tuple[float, float, float]


def backward_walk(graph, choice, fx_graph, cost_model, nodes, grad_bytes, extend=None) -> Walk:
    """The :class:`Walk` of the op nodes ``nodes`` (indices into the cost graph ``graph``, in
    graph order) under ``choice``; ``fx_graph`` holds their ``meta["autopar_backward"]``,
    ``grad_bytes(i)`` is the gradient bytes of parameter node ``i``; ``extend(name, strategy)``
    gives the strategy the cost model prices (a micro-batch cost graph's, with its micro-batch
    placement: :meth:`~autopar.planner.microbatch.WindowInfo.extend`)."""
    fx = {n.name: n for n in fx_graph.nodes}

    def strategy(i: int):
        s = graph.nodes[i].strategies[choice[i]]
        return s if extend is None else extend(graph.nodes[i].name, s)

    inside = set(nodes)
    last_use: dict[int, int] = {}  # parameter node -> its last consumer: its gradient appears there
    gathered: dict[int, float] = {}  # node -> bytes of the sharded parameters gathered for it
    for e in graph.edges:
        if graph.nodes[e.src].kind == "parameter":
            last_use[e.src] = max(last_use.get(e.src, -1), e.dst)
            if e.dst not in inside:
                continue
            stored, used = strategy(e.src).outputs[0], strategy(e.dst).inputs[e.in_index]
            if tuple(stored) != tuple(used):
                gathered[e.dst] = gathered.get(e.dst, 0.0) + cost_model.held_bytes(e.meta, used)
    appears: dict[int, float] = {}
    for src, dst in last_use.items():
        if dst in inside:
            appears[dst] = appears.get(dst, 0.0) + grad_bytes(src)
    saved = {i: float(graph.nodes[i].memory[choice[i]]) for i in nodes if graph.nodes[i].kind == "op"}
    remaining = total = sum(saved.values())
    made = 0.0
    peak = (0.0, 0.0, 0.0)
    for i in reversed(list(saved)):
        node = graph.nodes[i]
        if not node.requires_grad:
            continue
        running = gathered.get(i, 0.0) + cost_model.parts_memory(node.spec, strategy(i),
                                                                 fx[node.name].meta.get("autopar_backward", ()))
        peak = max(peak, (remaining, made, running), key=sum)
        remaining -= saved[i]
        made += appears.get(i, 0.0)  # its backward made these (counted in ``running`` meanwhile)
    return Walk(total, made, peak)


def step_peak(graph, choice, captured, cost_model, param_memory: dict) -> MemoryBreakdown:
    """The peak of the step (module docstring) of the cost graph ``graph`` under ``choice``
    (``param_memory``: parameter FQN -> its (parameter, gradient, optimizer) bytes per device)."""
    params, grads, optimizer = (sum(m[k] for m in param_memory.values()) for k in range(3))
    returned = {o.node for o in captured.outputs if o.kind == "user_output"}
    inputs = held = 0.0
    for node, c in zip(graph.nodes, choice):
        if node.kind == "user_input":
            inputs += float(node.memory[c])
        elif node.kind == "op" and node.name in returned:
            held += sum(cost_model.held_bytes(m, s) for m, s in zip(node.spec.outputs, node.strategies[c].outputs))
    walk = backward_walk(graph, choice, captured.graph_module.graph, cost_model, range(len(graph.nodes)),
                         lambda i: param_memory[graph.nodes[i].target][1])
    remaining, made, running = walk.peak
    backward = MemoryBreakdown(parameters=params, gradients=made, optimizer=optimizer,
                               activations=inputs + held + remaining, temporaries=running)
    scratch = params if MOMENTS[cost_model.options.optimizer] else 0.0
    step = MemoryBreakdown(parameters=params, gradients=grads, optimizer=optimizer, activations=inputs + held,
                           temporaries=scratch)
    return max(backward, step, key=lambda m: m.total)


__all__ = ["Walk", "backward_walk", "step_peak"]
