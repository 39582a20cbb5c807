"""The predicted peak memory of one training step of a one-program plan, phase by phase.

The ILP constrains a linear sum (model states plus every saved activation); the program never
holds all of that at once. Its peak is the larger of two moments (what ``verify`` measures):

- **backward**, walked node by node in reverse: parameters, optimizer state, the inputs and the
  outputs the program returns besides the loss (e.g. the logits, held to the end), what
  autograd saved (``meta["autopar_saved"]``) for the nodes whose backward has not run yet, the
  parameter gradients made so far (each appears at its last consumer's backward) and the
  backward of the node in flight (``meta["autopar_backward"]``: its gradients and scratch, e.g.
  the loss's gradients of the logits, and the sharded parameters gathered for it, ZeRO-3);
- **the optimizer step**: parameters, gradients, optimizer state, the inputs and the outputs the
  program returns besides the loss (e.g. the logits), and the optimizer's scratch (the foreach
  Adam step's square root of the second moment: one tensor of each parameter's size).
"""

from __future__ import annotations

from autopar.core.precision import MOMENTS
from autopar.plan import MemoryBreakdown


def step_peak(graph, choice, captured, cost_model, param_memory: dict) -> MemoryBreakdown:
    """The peak of the step (module docstring) of the cost graph ``graph`` under ``choice``
    (``param_memory``: parameter FQN -> its (parameter, gradient, optimizer) bytes per device)."""
    params, grads, optimizer = (sum(m[k] for m in param_memory.values()) for k in range(3))
    fx = {n.name: n for n in captured.graph_module.graph.nodes}
    returned = {o.node for o in captured.outputs if o.kind == "user_output"}
    last_use: dict[int, int] = {}  # parameter node -> its last consumer: its gradient appears there
    gathered: dict[int, float] = {}  # node -> bytes of the sharded parameters gathered for it
    for e in graph.edges:
        if graph.nodes[e.src].kind == "parameter":
            last_use[e.src] = max(last_use.get(e.src, -1), e.dst)
            stored = graph.nodes[e.src].strategies[choice[e.src]].outputs[0]
            used = graph.nodes[e.dst].strategies[choice[e.dst]].inputs[e.in_index]
            if tuple(stored) != tuple(used):
                gathered[e.dst] = gathered.get(e.dst, 0.0) + cost_model.held_bytes(e.meta, used)
    appears: dict[int, float] = {}
    for src, dst in last_use.items():
        appears[dst] = appears.get(dst, 0.0) + param_memory[graph.nodes[src].target][1]
    inputs = held = 0.0
    saved = [0.0] * len(graph.nodes)
    for i, (node, c) in enumerate(zip(graph.nodes, choice)):
        if node.kind == "user_input":
            inputs += float(node.memory[c])
        elif node.kind == "op":
            saved[i] = float(node.memory[c])
            if node.name in returned:
                held += sum(cost_model.held_bytes(m, s) for m, s in zip(node.spec.outputs, node.strategies[c].outputs))
    backward = MemoryBreakdown(parameters=params, gradients=0.0, optimizer=optimizer, activations=inputs + held,
                               temporaries=0.0)
    remaining, made = sum(saved), 0.0
    for i in reversed(range(len(graph.nodes))):
        node = graph.nodes[i]
        if node.kind != "op" or not node.requires_grad:
            continue
        running = gathered.get(i, 0.0) + cost_model.parts_memory(node.spec, node.strategies[choice[i]],
                                                                 fx[node.name].meta.get("autopar_backward", ()))
        here = MemoryBreakdown(parameters=params, gradients=made, optimizer=optimizer,
                               activations=inputs + held + remaining, temporaries=running)
        backward = max(backward, here, key=lambda m: m.total)
        remaining -= saved[i]
        made += appears.get(i, 0.0)  # its backward made these (counted in ``running`` meanwhile)
    scratch = params if MOMENTS[cost_model.options.optimizer] else 0.0
    step = MemoryBreakdown(parameters=params, gradients=grads, optimizer=optimizer, activations=inputs + held,
                           temporaries=scratch)
    return max(backward, step, key=lambda m: m.total)


__all__ = ["step_peak"]
