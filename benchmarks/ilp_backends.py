"""HiGHS vs CP-SAT on synthetic Alpa-shaped strategy ILPs, and the stage DP at 32 units.

Problems: a chain of ``n`` nodes with skip edges (a residual stream), ``k`` strategies each.
Every strategy has an input layout and an output layout out of a few; an edge costs nothing
when the producer's output layout is what the consumer wants and a size-proportional
resharding time otherwise. Memory rows are sliding windows of live activations on top of a
parameter constant, and the limit sits between the smallest and the cost-optimal peak, so it
binds. ``--kind random`` uses uniform random costs instead (harder than real graphs).

    python benchmarks/ilp_backends.py                      # 200, 1000, 3000 nodes × 8
    python benchmarks/ilp_backends.py --sizes 500 --time-limit 60 --kind random
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from autopar.solver import ILPProblem, MemoryRow, solve_ilp, solve_stages


def alpa_like_problem(n: int, k: int, *, seed: int, kind: str = "structured", window: int = 6) -> ILPProblem:
    rng = np.random.default_rng(seed)
    layouts = 4
    out_layout = rng.integers(0, layouts, size=(n, k))
    in_layout = rng.integers(0, layouts, size=(n, k))
    size = rng.lognormal(0.0, 1.0, size=n)  # tensor size scale per node
    degree = rng.choice([1, 2, 4, 8], size=(n, k))  # how far each strategy splits the work
    if kind == "structured":
        costs = [size[i] * (1.0 / degree[i] + 0.05 * rng.random(k)) for i in range(n)]
    else:
        costs = [rng.random(k) for _ in range(n)]
    edges = []

    def edge(u: int, v: int):
        if kind == "structured":
            mismatch = out_layout[u][:, None] != in_layout[v][None, :]
            matrix = mismatch * size[u] * rng.uniform(0.2, 1.0, size=(k, k))
        else:
            matrix = rng.random((k, k))
        edges.append((u, v, matrix))

    for v in range(1, n):
        edge(v - 1, v)
        if v >= 4 and v % 4 == 0:
            edge(v - 4, v)  # residual connection around a block
    memory = [size[i] * 1e9 / degree[i] * rng.uniform(0.8, 1.2, size=k) for i in range(n)]
    rows = [
        MemoryRow(terms=tuple((i, memory[i]) for i in range(max(0, t - window), t + 1)), constant=2e9)
        for t in range(0, n, 2)
    ]

    def peak(choice):
        return max(r.constant + sum(v[choice[i]] for i, v in r.terms) for r in rows)

    low = peak([int(np.argmin(m)) for m in memory])
    high = peak([int(np.argmin(c)) for c in costs])
    limit = low + 0.3 * max(high - low, 0.05 * low)
    return ILPProblem(node_costs=costs, edges=edges, memory_rows=rows, memory_limit=limit)


def stage_table(units: int, devices: list[int], *, batches: int, seed: int, memory_cap: float = 12.0) -> np.ndarray:
    """time[s − 1, i, j, m] of units i..j on sub-mesh m as the s-th stage from the end:
    roofline-ish, inf where its weights and its ``min(s, B)`` micro-batches of activations in
    flight (1F1B) do not fit ``memory_cap`` (a unit's weights weigh 1, its activations 1/B)."""
    rng = np.random.default_rng(seed)
    unit = rng.uniform(0.8, 1.2, size=units)
    prefix = np.concatenate([[0.0], np.cumsum(unit)])
    span = prefix[None, 1:] - prefix[:-1, None]  # [i, j] = Σ unit[i..j]
    table = np.full((units, units, units, len(devices)), np.inf)
    upper = np.triu(np.ones_like(span, bool))
    for m, d in enumerate(devices):
        efficiency = 0.9 ** np.log2(d)
        t = span / (d * efficiency) + 0.01 * np.log2(2 * d)
        for s in range(units):
            fits = upper & (span / d * (1 + min(s + 1, batches) / batches) <= memory_cap)
            table[s, :, :, m] = np.where(fits, t, np.inf)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 3000])
    parser.add_argument("--strategies", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--kind", choices=["structured", "random"], default="structured")
    parser.add_argument("--backends", nargs="+", default=["highs", "cpsat"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"ILP: {args.kind} chains with skip edges, {args.strategies} strategies, limit {args.time_limit:g} s")
    print(f"{'nodes':>6} {'vars':>8} {'rows':>7} " + " ".join(f"{b + ' s':>9} {b + ' obj':>13} {'gap':>8}" for b in args.backends))
    for n in args.sizes:
        problem = alpa_like_problem(n, args.strategies, seed=args.seed + n, kind=args.kind)
        cells, shape = [], ""
        for backend in args.backends:
            start = time.perf_counter()
            solution = solve_ilp(problem, backend=backend, time_limit_s=args.time_limit)
            wall = time.perf_counter() - start
            shape = f"{solution.num_variables:>8} {solution.num_constraints:>7}"
            mark = "" if solution.optimal else "*"
            cells.append(f"{wall:>8.2f}{mark:1} {solution.objective:>13.6f} {solution.gap:>8.1e}")
        print(f"{n:>6} {shape} " + " ".join(cells), flush=True)
    print("(* = stopped by the time limit; times include building the model)")

    devices = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]
    for batches in (1, 8, 32, 128):
        table = stage_table(32, devices, batches=batches, seed=args.seed)
        start = time.perf_counter()
        plan = solve_stages(stage_times=table, submesh_devices=devices, total_devices=64, num_microbatches=batches)
        wall = time.perf_counter() - start
        print(
            f"stage DP: 32 units, {len(devices)} sub-meshes, 64 devices, B={batches:>3}: {wall:.3f} s, "
            f"{len(plan.stages)} stages, latency {plan.latency:.3f}, bubble {plan.bubble_fraction:.3f}"
        )


if __name__ == "__main__":
    main()
