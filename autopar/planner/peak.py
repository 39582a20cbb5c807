"""The predicted peak memory of one training step of a one-program plan, phase by phase.

The ILP constrains a linear sum (model states plus every saved activation, a storage several
nodes keep shared among them); the program never holds all of that at once, and holds what the
sum leaves out (a backward's gradients and scratch, a second copy of a saved tensor). This peak
is the one a plan reports, and the one it must fit in: where it is above the sum,
:func:`~autopar.planner.intra.plan_intra` solves again with the sum bounded by the limit less the
excess. Its peak is the larger of two moments (what ``verify`` measures):

- **backward**, walked node by node in reverse: parameters, optimizer state, the inputs and the
  outputs the program returns besides the loss (e.g. the logits, held to the end), what
  autograd saved (``meta["autopar_saved"]``) until the backward of the first node that saved it
  has run (one copy per sharding a storage is saved at: a tensor resharded for a consumer that
  saves it is held twice, the producer's and the consumer's), the
  parameter gradients made so far (each appears at its last consumer's backward), the
  activations' gradients waiting (each made by its value's last consumer's backward and held
  until its producer's has run: a residual stream's across its branch) and the
  backward of the node in flight (``meta["autopar_backward"]``: its gradients and scratch, e.g.
  the loss's gradients of the logits, and the sharded parameters gathered for it, ZeRO-3, and
  the whole gradients of parameters gathered once for several consumers, summed until the first
  one's backward); after a node's backward, the collective that takes an input's gradient back
  to its producer's sharding holds the gradient, its resharded copy and its own buffers;
- **the optimizer step**: parameters, gradients, optimizer state, the inputs and the outputs the
  program returns besides the loss (e.g. the logits), and the optimizer's scratch (the foreach
  Adam step's square root of the second moment: one tensor of each parameter's size).
"""

from __future__ import annotations

from itertools import accumulate

from autopar.core.collective_kinds import BUFFERS
from autopar.core.precision import MOMENTS
from autopar.plan import MemoryBreakdown


def step_peak(graph, choice, captured, cost_model, param_memory: dict) -> MemoryBreakdown:
    """The peak of the step (module docstring) of the cost graph ``graph`` under ``choice``
    (``param_memory``: parameter FQN -> its (parameter, gradient, optimizer) bytes per device)."""
    params, grads, optimizer = (sum(m[k] for m in param_memory.values()) for k in range(3))
    fx = {n.name: n for n in captured.graph_module.graph.nodes}
    returned = {o.node for o in captured.outputs if o.kind == "user_output"}
    last_use, gathered, summing = _parameter_uses(graph, choice, cost_model)
    resharded = _backward_collectives(graph, choice, cost_model)
    pending = _pending_gradients(graph, choice, cost_model)
    appears: dict[int, float] = {}
    for src, dst in last_use.items():
        appears[dst] = appears.get(dst, 0.0) + param_memory[graph.nodes[src].target][1]
    inputs = held = 0.0
    copies: dict[tuple, list] = {}  # (saved storage, its layer, sharding) -> [bytes, its first holder]
    for i, (node, c) in enumerate(zip(graph.nodes, choice)):
        if node.kind == "user_input":
            inputs += float(node.memory[c])
        elif node.kind == "op":
            layer = fx[node.name].meta.get("autopar_layer")  # stamped layers repeat their template's numbers
            for part in fx[node.name].meta.get("autopar_saved", ()):
                sharding, nbytes = cost_model.part_bytes(node.spec, node.strategies[c], part)
                copy = copies.setdefault((part.storage, layer, sharding), [nbytes, i])
                copy[1] = min(copy[1], i)
            if node.name in returned:
                held += sum(cost_model.held_bytes(m, s) for m, s in zip(node.spec.outputs, node.strategies[c].outputs))
    backward = MemoryBreakdown(parameters=params, gradients=0.0, optimizer=optimizer, activations=inputs + held,
                               temporaries=0.0)
    saved = [0.0] * len(graph.nodes)  # node -> bytes freed when its backward has run
    for nbytes, first in copies.values():
        saved[first] += nbytes
    remaining, made = sum(saved), 0.0
    for i in reversed(range(len(graph.nodes))):
        node = graph.nodes[i]
        if node.kind != "op" or not node.requires_grad:
            continue
        running = gathered.get(i, 0.0) + summing[i] + pending[i] + cost_model.parts_memory(
            node.spec, node.strategies[choice[i]], fx[node.name].meta.get("autopar_backward", ()))
        here = MemoryBreakdown(parameters=params, gradients=made, optimizer=optimizer,
                               activations=inputs + held + remaining, temporaries=running)
        backward = max(backward, here, key=lambda m: m.total)
        remaining -= saved[i]
        made += appears.get(i, 0.0)  # its backward made these (counted in ``running`` meanwhile)
        if i in resharded:  # then its input's gradient goes back through a collective
            grad, buffers = resharded[i]
            here = MemoryBreakdown(parameters=params, gradients=made, optimizer=optimizer,
                                   activations=inputs + held + remaining, temporaries=pending[i] + grad,
                                   communication=buffers)
            backward = max(backward, here, key=lambda m: m.total)
    scratch = params if MOMENTS[cost_model.options.optimizer] else 0.0
    step = MemoryBreakdown(parameters=params, gradients=grads, optimizer=optimizer, activations=inputs + held,
                           temporaries=scratch)
    return max(backward, step, key=lambda m: m.total)


def _pending_gradients(graph, choice, cost_model) -> list[float]:
    """Node -> bytes of the gradients waiting while its backward runs: a value's gradient is made
    by its last consumer's backward and held until its producer's has run."""
    last: dict[tuple, list] = {}  # (producer, output) -> [its tensor, its last consumer taking a gradient]
    for e in graph.edges:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        if src.kind == "op" and src.requires_grad and dst.requires_grad and e.meta.dtype.is_floating_point:
            value = last.setdefault((e.src, e.out_index), [e.meta, e.dst])
            value[1] = max(value[1], e.dst)
    change = [0.0] * (len(graph.nodes) + 1)
    for (src, out), (meta, dst) in last.items():
        if dst > src + 1:
            nbytes = cost_model.held_bytes(meta, graph.nodes[src].strategies[choice[src]].outputs[out])
            change[src + 1] += nbytes
            change[dst] -= nbytes
    return list(accumulate(change[:-1]))


def _backward_collectives(graph, choice, cost_model) -> dict[int, tuple[float, float]]:
    """Node -> (bytes of a gradient and its resharded copy, bytes of the collective's own buffers,
    :data:`~autopar.core.collective_kinds.BUFFERS`) of the largest collective that takes one of its
    inputs' gradients back to the producer's sharding after its backward."""
    out: dict[int, tuple[float, float]] = {}
    for e in graph.edges:
        src, dst = graph.nodes[e.src], graph.nodes[e.dst]
        if src.kind != "op" or not src.requires_grad or not e.meta.dtype.is_floating_point:
            continue
        s, t = src.strategies[choice[e.src]], dst.strategies[choice[e.dst]]
        steps = [c for c in cost_model.collectives(e.meta, s.outputs[e.out_index], t.inputs[e.in_index], t, grad=True)
                 if c.phase == "backward"]
        if not steps:
            continue
        grad = sum(cost_model.held_bytes(e.meta, side) for side in (t.inputs[e.in_index], s.outputs[e.out_index]))
        buffers = max(BUFFERS.get(c.kind, 0.0) * c.nbytes for c in steps)
        if sum(out.get(e.dst, (0.0, 0.0))) < grad + buffers:
            out[e.dst] = (grad, buffers)
    return out


def _parameter_uses(graph, choice, cost_model) -> tuple[dict, dict, list]:
    """(parameter node -> its last consumer, node -> bytes of the sharded parameters gathered for
    it, node -> bytes of whole gradients summed while its backward runs). A parameter gathered
    once for several consumers (a tied embedding and output projection) sums their gradients at
    the gathered size, from its last consumer's backward to its first's, before it is reduced."""
    last_use: dict[int, int] = {}
    gathered: dict[int, float] = {}
    uses: dict[tuple, list] = {}  # (parameter, sharding used) -> [bytes, first consumer, last consumer]
    for e in graph.edges:
        if graph.nodes[e.src].kind == "parameter":
            last_use[e.src] = max(last_use.get(e.src, -1), e.dst)
            stored = tuple(graph.nodes[e.src].strategies[choice[e.src]].outputs[0])
            used = tuple(graph.nodes[e.dst].strategies[choice[e.dst]].inputs[e.in_index])
            if stored != used:
                nbytes = cost_model.held_bytes(e.meta, used)
                gathered[e.dst] = gathered.get(e.dst, 0.0) + nbytes
                use = uses.setdefault((e.src, used), [nbytes, e.dst, e.dst])
                use[1], use[2] = min(use[1], e.dst), max(use[2], e.dst)
    summing = [0.0] * len(graph.nodes)
    for nbytes, first, last in uses.values():
        for i in range(first, last):
            summing[i] += nbytes
    return last_use, gathered, summing


__all__ = ["step_peak"]
