"""Repeat labels: which nodes may share one sharding decision, written as ``meta["autopar_repeat"]``.

Two kinds of repetition are labelled, and the planner ties nodes position by position across
equal-looking labels (:mod:`autopar.planner.simplify`):

- **repeated blocks** (:func:`autopar.passes.capture.layers.repeated_blocks`): a node (or a
  parameter placeholder) whose module lies in block ``encoder.block.3`` is labelled with it;
- **unrolled loops**: inside one block's compute nodes (or among the nodes of no block), a run
  of at least :data:`MIN_ITERATIONS` back-to-back copies of one op sequence, as torch.export
  writes a Python loop over time steps (Mamba's selective scan: one body per token), labels
  iteration ``t`` of the ``j``-th such run ``<block>#<j>.<t>``. Copies are compared by op,
  output shape and dtype and input shapes and dtypes: every copy then has the same strategies.

Everything else is labelled ``None``. A run is found from each node by trying the next few
places its key recurs as the period and growing the run while the keys keep repeating: about
linear in the nodes for graphs without long runs, and each run is walked once.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from autopar.passes.capture.layers import layer_of

LOOP = "#"  # marks a loop iteration in a label: ``<block>#<run>.<step>``
MIN_ITERATIONS = 16  # back-to-back copies that make an unrolled loop (not q/k/v or a few experts)
PERIODS_TRIED = 4  # next recurrences of a node's key tried as the loop's period


def _key(node: torch.fx.Node) -> tuple:
    return (str(node.target), node.meta.get("autopar_tensor"),
            tuple(a.meta.get("autopar_tensor") for a in node.all_input_nodes))


def loop_runs(keys: list) -> list[tuple[int, int, int]]:
    """``(start, period, iterations)`` of every run of at least :data:`MIN_ITERATIONS` back-to-back
    copies of a key sequence in ``keys``, in order, not overlapping."""
    ids: dict = {}
    keys = [ids.setdefault(k, len(ids)) for k in keys]  # small ints compare fast
    n, last = len(keys), {}
    following = [n] * n  # following[i]: the next position of keys[i] (n: none)
    for i in range(n - 1, -1, -1):
        following[i] = last.get(keys[i], n)
        last[keys[i]] = i
    runs, i = [], 0
    while i < n:
        best = None
        j = i
        for _ in range(PERIODS_TRIED):
            j = following[j]
            if j == n:
                break
            period, length = j - i, 0
            while i + period + length < n and keys[i + length] == keys[i + period + length]:
                length += 1
            iterations = 1 + length // period
            if iterations >= MIN_ITERATIONS and (best is None or iterations * period > best[1] * best[2]):
                best = (i, period, iterations)
        if best is None:
            i += 1
            continue
        runs.append(best)
        i += best[1] * best[2]
    return runs


def repeats_pass(gm: torch.fx.GraphModule, blocks: frozenset[str]) -> None:
    """Write ``meta["autopar_repeat"]`` on every node of ``gm`` (module docstring)."""
    region: dict[str | None, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        label = None if node.op == "output" else layer_of(node.meta.get("autopar_module", ""), blocks)
        node.meta["autopar_repeat"] = label
        if node.op == "call_function":
            region[label].append(node)
    for label, nodes in region.items():
        for j, (start, period, iterations) in enumerate(loop_runs([_key(n) for n in nodes])):
            for t in range(iterations):
                for node in nodes[start + t * period:start + (t + 1) * period]:
                    node.meta["autopar_repeat"] = f"{label or ''}{LOOP}{j}.{t}"


__all__ = ["LOOP", "MIN_ITERATIONS", "loop_runs", "repeats_pass"]
