"""Intra-op strategy selection as an integer linear program (Alpa-style): numpy in, numpy out.

Node ``i`` has ``k_i`` strategies with cost vector ``c_i`` (seconds); ``s_i ∈ {0,1}^{k_i}`` is
its one-hot choice. Edge ``(u, v)`` has a resharding matrix ``R_uv`` (``k_u × k_v``) and a
variable matrix ``e_uv ∈ [0,1]^{k_u×k_v}`` standing for ``s_u s_vᵀ``. Memory row ``r`` has a
constant ``K_r`` and per-node byte vectors ``m_ri``::

    minimise    Σ_i c_i·s_i + Σ_(u,v) ⟨R_uv, e_uv⟩
    subject to  Σ_a s_i[a] = 1                          every node i       (_add_one_hot)
                Σ_b e_uv[a,b] = s_u[a]   for every a,
                Σ_a e_uv[a,b] = s_v[b]   for every b     every edge (u, v)  (_add_edge_marginals)
                K_r + Σ_i m_ri·s_i ≤ memory_limit         every memory row r (_add_memory_rows)
                s_u = s_v                                 every tie (u, v)   (_merge_ties)

The marginal equations force ``e = s_u s_vᵀ`` once ``s`` is integral, so ``e`` is continuous.
Strategies with equal rows of ``R_uv`` (columns) share a row (column) of ``e`` whose marginal is
the sum of their ``s`` (:func:`_add_edge_marginals`); the written form is the case of distinct rows.
They are tighter than ``e ≥ s_u[a] + s_v[b] − 1`` (their LP relaxation is the local
polytope) and cost ``k_u + k_v`` rows per edge instead of ``k_u·k_v``. Ties are substituted:
tied nodes share one vector ``s``. When no plan fits, a second program finds the smallest
achievable peak: minimise ``P`` subject to one-hot, ties and ``K_r + Σ_i m_ri·s_i ≤ P``
(_add_peak_rows).

Before solving, :func:`_presolve` rewrites the problem exactly: tied nodes merge, nodes with
one strategy become constants, each edge matrix is split as ``R = r1ᵀ + 1cᵀ + R'`` (row
minima, then column minima, moved into the node costs) and dropped when ``R' = 0``, and nodes
left in no edge and no binding memory row take their cheapest strategy. Problems with nothing
left to decide never reach a solver. The rest is first solved without memory rows by exact
variable elimination (:func:`autopar.solver.eliminate.eliminate`); when that optimum fits every
memory row it is the optimum of the whole program (backend ``"elimination"``), and only
otherwise (or when the graph is too entangled to eliminate) is the ILP built and solved.

Backends (both through ``ortools.math_opt``): ``"highs"`` (costs divided by the largest
coefficient, bytes by the largest row activity) and ``"cpsat"`` (all data made integer: costs
times ``σ = 2^⌊log2(2^30/U)⌋``, ``U`` an upper bound of the objective, and bytes times
``μ = 2^⌊log2(2^30/A)⌋``, ``A`` the largest row activity, rounded to the nearest integer). With
``T`` cost terms in a plan (free nodes + edges), rounding moves a plan's cost by at most
``T/(2σ)``, so CP-SAT's plan costs at most ``T/σ ≤ T·U/2^29`` more than the optimum, and a
memory row is off by at most ``(terms + 1)/(2μ) ≤ (terms + 1)·A/2^30`` bytes. Reported objectives and peaks are
always recomputed exactly from the chosen strategies.

Example::

    problem = ILPProblem(node_costs=[np.array([1.0, 2.0]), np.array([3.0, 0.5])],
                         edges=[(0, 1, np.array([[0.0, 4.0], [1.0, 0.0]]))])
    solve_ilp(problem).choice        # array([1, 1])
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from ortools.math_opt import model_pb2
from ortools.math_opt.python import mathopt

from autopar.core.errors import InfeasibleError, SolverInputError, SolverTimeoutError
from autopar.core.options import BACKENDS
from autopar.solver.eliminate import eliminate

# Integer range that scaled costs and bytes are fitted into for CP-SAT. At 2^40 CP-SAT (9.15)
# proved "optimal" a plan 4e-6 worse than HiGHS's optimum on a 200-node problem with memory
# rows, and was 6× slower; at 2^30 it matched HiGHS.
_CPSAT_RANGE = 2.0**30


def _vector(values, what: str) -> np.ndarray:
    array = np.array(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise SolverInputError(f"{what} must be a non-empty 1-D array, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise SolverInputError(f"{what} must be finite and non-negative, got {array}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True)
class MemoryRow:
    """Bytes live on the worst device at one program point: ``constant + Σ vector[choice[node]]``."""

    terms: tuple[tuple[int, np.ndarray], ...]
    constant: float = 0.0

    def __post_init__(self):
        terms = []
        for term in self.terms:
            if len(term) != 2 or isinstance(term[0], bool) or not isinstance(term[0], (int, np.integer)):
                raise SolverInputError(f"a memory term must be (node index, byte vector), got {term!r}")
            terms.append((int(term[0]), _vector(term[1], f"memory vector of node {term[0]}")))
        if not math.isfinite(self.constant) or self.constant < 0:
            raise SolverInputError(f"memory row constant must be finite and ≥ 0, got {self.constant}")
        object.__setattr__(self, "terms", tuple(terms))
        object.__setattr__(self, "constant", float(self.constant))


@dataclass(frozen=True, eq=False)
class ILPProblem:
    """One strategy per node; node costs, edge resharding matrices, memory rows, tied nodes."""

    node_costs: Sequence[np.ndarray]
    edges: Sequence[tuple[int, int, np.ndarray]] = ()
    memory_rows: Sequence[MemoryRow] = ()
    memory_limit: float | None = None
    ties: Sequence[tuple[int, int]] = ()

    def __post_init__(self):
        costs = tuple(_vector(c, f"node_costs[{i}]") for i, c in enumerate(self.node_costs))
        n = len(costs)
        sizes = [len(c) for c in costs]

        def node(index, where: str) -> int:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n:
                raise SolverInputError(f"{where}: node index {index!r} is not in 0..{n - 1}")
            return int(index)

        edges = []
        for e, edge in enumerate(self.edges):
            if len(edge) != 3:
                raise SolverInputError(f"edges[{e}] must be (u, v, matrix), got {len(edge)} items")
            u, v = node(edge[0], f"edges[{e}]"), node(edge[1], f"edges[{e}]")
            if u == v:
                raise SolverInputError(f"edges[{e}] joins node {u} to itself; fold it into node_costs[{u}]")
            matrix = np.array(edge[2], dtype=np.float64)
            if matrix.shape != (sizes[u], sizes[v]):
                raise SolverInputError(
                    f"edges[{e}] ({u}→{v}) matrix has shape {matrix.shape}, expected {(sizes[u], sizes[v])}"
                )
            if not np.all(np.isfinite(matrix)) or np.any(matrix < 0):
                raise SolverInputError(f"edges[{e}] ({u}→{v}) costs must be finite and non-negative")
            matrix.setflags(write=False)
            edges.append((u, v, matrix))
        rows = tuple(self.memory_rows)
        for r, row in enumerate(rows):
            if not isinstance(row, MemoryRow):
                raise SolverInputError(f"memory_rows[{r}] must be a MemoryRow, got {type(row).__name__}")
            for i, vector in row.terms:
                if len(vector) != sizes[node(i, f"memory_rows[{r}]")]:
                    raise SolverInputError(
                        f"memory_rows[{r}]: node {i} has {sizes[i]} strategies but its vector has {len(vector)}"
                    )
        limit = self.memory_limit
        if limit is not None:
            if isinstance(limit, bool) or not math.isfinite(limit) or limit < 0:
                raise SolverInputError(f"memory_limit must be None or finite and ≥ 0, got {limit!r}")
            limit = float(limit)
        ties = []
        for t, tie in enumerate(self.ties):
            if len(tie) != 2:
                raise SolverInputError(f"ties[{t}] must be a pair of node indices, got {tie!r}")
            u, v = node(tie[0], f"ties[{t}]"), node(tie[1], f"ties[{t}]")
            if sizes[u] != sizes[v]:
                raise SolverInputError(
                    f"ties[{t}] joins node {u} ({sizes[u]} strategies) and node {v} ({sizes[v]}); "
                    "tied nodes must offer the same strategies in the same order"
                )
            ties.append((u, v))
        object.__setattr__(self, "node_costs", costs)
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "memory_rows", rows)
        object.__setattr__(self, "memory_limit", limit)
        object.__setattr__(self, "ties", tuple(ties))

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def _checked_choice(self, choice) -> np.ndarray:
        choice = np.asarray(choice)
        if choice.shape != (self.num_nodes,) or not np.issubdtype(choice.dtype, np.integer):
            raise SolverInputError(f"choice must be {self.num_nodes} integers, got {choice.dtype} {choice.shape}")
        for i, (a, c) in enumerate(zip(choice, self.node_costs)):
            if not 0 <= a < len(c):
                raise SolverInputError(f"choice[{i}] = {a} but node {i} has {len(c)} strategies")
        return choice

    def objective_of(self, choice) -> float:
        """Total cost of one strategy per node (ties are not checked)."""
        choice = self._checked_choice(choice)
        total = sum(float(c[a]) for c, a in zip(self.node_costs, choice))
        return total + sum(float(m[choice[u], choice[v]]) for u, v, m in self.edges)

    def peak_of(self, choice) -> float:
        """Largest memory row for one strategy per node; 0 when there are no rows."""
        choice = self._checked_choice(choice)
        return max(
            (row.constant + sum(float(vec[choice[i]]) for i, vec in row.terms) for row in self.memory_rows),
            default=0.0,
        )


@dataclass(frozen=True, eq=False)
class ILPSolution:
    """The chosen strategy per node and how the solve went (``gap`` is relative, ≥ 0)."""

    choice: np.ndarray
    objective: float
    peak_memory: float
    optimal: bool  # proved optimal within the requested relative gap
    gap: float
    status: str  # "optimal", "time_limit" or "trivial" (no solver needed)
    solve_time_s: float  # wall time of the whole call: presolve, building, solving
    num_variables: int
    num_constraints: int
    backend: str  # "highs", "cpsat", "elimination" or "none"


# ----------------------------------------------------------------------------- presolve


@dataclass
class _Reduced:
    """The presolved problem over groups of tied nodes; ``free`` groups still have a choice."""

    group_of: np.ndarray  # node → group
    costs: list[np.ndarray]  # per group
    edges: list[tuple[int, int, np.ndarray]]  # residual matrices, groups g < h, both free
    rows: list[tuple[float, dict[int, np.ndarray]]]  # every memory row: (constant, group → bytes)
    offset: float
    fixed: dict[int, int] = field(default_factory=dict)  # group → strategy decided in presolve


def _merge_ties(problem: ILPProblem) -> np.ndarray:
    """Ties by substitution: tied nodes map to one group and share one one-hot vector."""
    parent = list(range(problem.num_nodes))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for u, v in problem.ties:
        a, b = root(u), root(v)
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [root(i) for i in range(problem.num_nodes)]
    _, group_of = np.unique(roots, return_inverse=True)
    return group_of.astype(np.int64)


def _presolve(problem: ILPProblem) -> _Reduced:
    group_of = _merge_ties(problem)
    num_groups = int(group_of.max()) + 1 if problem.num_nodes else 0
    costs = [np.zeros(0)] * num_groups
    for i, c in enumerate(problem.node_costs):
        g = group_of[i]
        costs[g] = c.copy() if costs[g].size == 0 else costs[g] + c
    sizes = [len(c) for c in costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for u, v, matrix in problem.edges:
        g, h = group_of[u], group_of[v]
        if g == h:
            costs[g] = costs[g] + np.diag(matrix)
            continue
        if g > h:
            g, h, matrix = h, g, matrix.T
        merged[(g, h)] = merged[(g, h)] + matrix if (g, h) in merged else matrix.copy()
    edges = []
    for (g, h), matrix in merged.items():
        row_min = matrix.min(axis=1)
        matrix = matrix - row_min[:, None]
        col_min = matrix.min(axis=0)
        matrix = matrix - col_min[None, :]
        costs[g] = costs[g] + row_min
        costs[h] = costs[h] + col_min
        if sizes[g] > 1 and sizes[h] > 1 and matrix.max() > 0:
            edges.append((int(g), int(h), matrix))
    # With one strategy on either side the residual is zero: the minima moved everything.
    offset = 0.0
    fixed = {}
    for g, c in enumerate(costs):
        if sizes[g] == 1:
            fixed[g] = 0
            offset += float(c[0])
    rows = []
    for row in problem.memory_rows:
        constant = row.constant
        terms: dict[int, np.ndarray] = {}
        for i, vector in row.terms:
            g = int(group_of[i])
            terms[g] = terms[g] + vector if g in terms else vector.copy()
        reduced = {}
        for g, vector in terms.items():
            low = float(vector.min())
            constant += low
            if sizes[g] > 1 and vector.max() > low:
                reduced[g] = vector - low
        rows.append((constant, reduced))
    return _Reduced(group_of=group_of, costs=costs, edges=edges, rows=rows, offset=offset, fixed=fixed)


def _row_max(row: tuple[float, dict[int, np.ndarray]]) -> float:
    return row[0] + sum(float(v.max()) for v in row[1].values())


# ----------------------------------------------------------------------------- program building


class _Program:
    """A mixed-integer linear program in plain arrays: variables, objective, sparse rows."""

    def __init__(self):
        self.objective: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.num_vars = 0
        self.entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (row, col, coef)
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []

    def add_vars(self, count: int, *, objective=None, upper=1.0, integer: bool) -> np.ndarray:
        ids = np.arange(self.num_vars, self.num_vars + count)
        self.num_vars += count
        self.objective.append(np.zeros(count) if objective is None else np.asarray(objective, float))
        self.upper.append(np.full(count, float(upper)))
        self.integer.append(np.full(count, integer))
        return ids

    def add_row(self, cols, coefs, *, lower: float, upper: float) -> None:
        row = len(self.row_lower)
        cols = np.asarray(cols, dtype=np.int64)
        self.entries.append((np.full(cols.size, row), cols, np.asarray(coefs, dtype=np.float64)))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


def _add_one_hot(program: _Program, groups: list[int], costs: list[np.ndarray], scale: float) -> dict:
    """One vector s_g per free group, Σ_a s_g[a] = 1; its objective is the group's cost."""
    s = {}
    for g in groups:
        s[g] = program.add_vars(len(costs[g]), objective=costs[g] * scale, integer=True)
        program.add_row(s[g], np.ones(len(s[g])), lower=1.0, upper=1.0)
    return s


def _add_edge_marginals(program: _Program, edges, s: dict, scale: float, *, integer: bool) -> list:
    """Product variables e_gh with row sums equal to s_g and column sums equal to s_h.

    Strategies of ``g`` with equal rows of ``R_gh`` (and of ``h`` with equal columns) share one
    row (column) of ``e``, its marginal being the sum of their ``s``: for integral ``s`` the one
    chosen class pair still carries the product, at the same cost, with fewer variables and rows.
    Returns, per edge, ``(e, row class of each g strategy, column class of each h strategy)``."""
    product = []
    for g, h, matrix in edges:
        rows, row_of = np.unique(matrix, axis=0, return_inverse=True)
        unique, col_of = np.unique(rows, axis=1, return_inverse=True)
        row_of, col_of = row_of.ravel(), col_of.ravel()
        kr, kc = unique.shape
        e = program.add_vars(kr * kc, objective=unique.ravel() * scale, integer=integer).reshape(kr, kc)
        product.append((e, row_of, col_of))
        for r in range(kr):
            members = s[g][row_of == r]
            program.add_row(np.append(e[r], members), np.append(np.ones(kc), -np.ones(len(members))),
                            lower=0.0, upper=0.0)
        for c in range(kc):
            members = s[h][col_of == c]
            program.add_row(np.append(e[:, c], members), np.append(np.ones(kr), -np.ones(len(members))),
                            lower=0.0, upper=0.0)
    return product


def _row_entries(terms: dict[int, np.ndarray], s: dict, scale: float):
    cols = np.concatenate([s[g] for g in terms]) if terms else np.zeros(0, np.int64)
    coefs = np.concatenate([v for v in terms.values()]) * scale if terms else np.zeros(0)
    return cols, coefs


def _add_memory_rows(program: _Program, rows, s: dict, limit: float, scale: float) -> None:
    """K_r + Σ m_r·s ≤ limit for every row that some plan could break."""
    for constant, terms in rows:
        cols, coefs = _row_entries(terms, s, scale)
        program.add_row(cols, coefs, lower=-math.inf, upper=(limit - constant) * scale)


def _add_peak_rows(program: _Program, rows, s: dict, scale: float, *, integer: bool) -> int:
    """A variable P (the objective) with K_r + Σ m_r·s ≤ P for every row; returns P's index."""
    top = max(_row_max(r) for r in rows) * scale
    peak = int(program.add_vars(1, objective=[1.0], upper=math.ceil(top) if integer else top, integer=integer)[0])
    for constant, terms in rows:
        cols, coefs = _row_entries(terms, s, scale)
        program.add_row(np.append(cols, peak), np.append(coefs, -1.0), lower=-math.inf, upper=-constant * scale)
    return peak


# ----------------------------------------------------------------------------- backends


@dataclass
class _Outcome:
    values: np.ndarray | None  # variable values of the best solution, None if none was found
    infeasible: bool
    proved: bool  # the solver proved optimality within the requested gap (in its own units)
    dual_bound: float  # in the program's units
    detail: str


def _to_proto(program: _Program, *, make_integer: bool) -> model_pb2.ModelProto:
    proto = model_pb2.ModelProto()
    n = program.num_vars
    objective = np.concatenate(program.objective) if n else np.zeros(0)
    upper = np.concatenate(program.upper) if n else np.zeros(0)
    integer = np.concatenate(program.integer) if n else np.zeros(0, bool)
    row_lower, row_upper = np.array(program.row_lower), np.array(program.row_upper)
    rows, cols, coefs = (np.concatenate(parts) for parts in zip(*program.entries))
    if make_integer:  # CP-SAT: every number integral (the caller scaled them); see module doc
        objective, coefs, upper = np.rint(objective), np.rint(coefs), np.floor(upper + 1e-9)
        row_lower = np.where(np.isfinite(row_lower), np.ceil(row_lower - 1e-9), row_lower)
        row_upper = np.where(np.isfinite(row_upper), np.floor(row_upper + 1e-9), row_upper)
        integer = np.ones(n, bool)
    keep = coefs != 0
    rows, cols, coefs = rows[keep], cols[keep], coefs[keep]
    order = np.lexsort((cols, rows))
    variables = proto.variables
    variables.ids.extend(range(n))
    variables.lower_bounds.extend(np.zeros(n).tolist())
    variables.upper_bounds.extend(upper.tolist())
    variables.integers.extend(integer.tolist())
    nonzero = np.flatnonzero(objective)
    proto.objective.linear_coefficients.ids.extend(nonzero.tolist())
    proto.objective.linear_coefficients.values.extend(objective[nonzero].tolist())
    constraints = proto.linear_constraints
    constraints.ids.extend(range(len(row_lower)))
    constraints.lower_bounds.extend(row_lower.tolist())
    constraints.upper_bounds.extend(row_upper.tolist())
    matrix = proto.linear_constraint_matrix
    matrix.row_ids.extend(rows[order].tolist())
    matrix.column_ids.extend(cols[order].tolist())
    matrix.coefficients.extend(coefs[order].tolist())
    return proto


def _run(program: _Program, *, backend: str, time_limit_s: float, relative_gap: float, workers: int, hint=None) -> _Outcome:
    """Solve with one backend; ``hint`` (indices of the variables at 1 in a feasible plan) seeds the search."""
    cpsat = backend == "cpsat"
    model = mathopt.Model.from_model_proto(_to_proto(program, make_integer=cpsat))
    model_params = mathopt.ModelSolveParameters()
    if hint is not None:
        ones = {model.get_variable(int(i)): 1.0 for i in hint}
        model_params.solution_hints.append(mathopt.SolutionHint(variable_values=ones))
    params = mathopt.SolveParameters(
        time_limit=datetime.timedelta(seconds=float(time_limit_s)),
        relative_gap_tolerance=relative_gap,
        absolute_gap_tolerance=0.0,
    )
    if cpsat:
        params.threads = workers
        params.cp_sat.mip_max_bound = 2.0**40  # the peak variable reaches 2^30; default refuses > 1e7
    else:  # HiGHS takes no thread count through math_opt; it picks its own
        params.highs.double_options["mip_feasibility_tolerance"] = 1e-9
    solver = mathopt.SolverType.CP_SAT if cpsat else mathopt.SolverType.HIGHS
    result = mathopt.solve(model, solver, params=params, model_params=model_params)
    reason = result.termination.reason
    detail = f"{reason.name}: {result.termination.detail}"
    infeasible = reason == mathopt.TerminationReason.INFEASIBLE
    if reason not in (
        mathopt.TerminationReason.OPTIMAL,
        mathopt.TerminationReason.FEASIBLE,
        mathopt.TerminationReason.INFEASIBLE,
        mathopt.TerminationReason.NO_SOLUTION_FOUND,
    ):
        raise SolverTimeoutError(f"the {backend} solver stopped without a usable answer ({detail})")
    values = None
    if result.has_primal_feasible_solution():
        found = result.solutions[0].primal_solution.variable_values
        values = np.zeros(program.num_vars)
        values[[v.id for v in found]] = list(found.values())
    proved = reason == mathopt.TerminationReason.OPTIMAL
    return _Outcome(values, infeasible, proved, result.termination.objective_bounds.dual_bound, detail)


# ----------------------------------------------------------------------------- solving


def _scales(reduced: _Reduced, groups, rows, *, backend: str) -> tuple[float, float]:
    """(cost scale, byte scale) as the module docstring describes for each backend."""
    costs = [reduced.costs[g] for g in groups] + [m for _, _, m in reduced.edges]
    activity = max((_row_max(r) for r in rows), default=0.0)
    if backend == "highs":
        largest = max((float(c.max()) for c in costs), default=0.0)
        return (1.0 / largest if largest > 0 else 1.0), (1.0 / activity if activity > 0 else 1.0)
    bound = sum(float(c.max()) for c in costs)

    def power(top: float) -> float:
        return 2.0 ** math.floor(math.log2(_CPSAT_RANGE / top)) if top > 0 else 1.0

    return power(bound), power(activity)


def _choice_of(problem: ILPProblem, reduced: _Reduced, decided: dict[int, int]) -> np.ndarray:
    choice = np.array([decided.get(int(g), reduced.fixed.get(int(g), 0)) for g in reduced.group_of], dtype=np.int64)
    choice.setflags(write=False)
    return choice


def _decode(values: np.ndarray, s: dict) -> dict[int, int]:
    return {g: int(np.argmax(values[ids])) for g, ids in s.items()}


def _greedy_hint(reduced: _Reduced, s: dict, products: list, rows, limit) -> np.ndarray | None:
    """A starting plan that fits the memory limit: each group's cheapest strategy, else each
    group's least-memory one (the fastest among equals); None when neither fits."""
    cheapest = {g: int(np.argmin(reduced.costs[g])) for g in s}
    leanest = {g: _cheapest(_group_memory(reduced, g), reduced.costs[g]) for g in s}
    pick = next((p for p in (cheapest, leanest)
                 if all(c + sum(float(v[p[g]]) for g, v in terms.items()) <= limit for c, terms in rows)), None)
    if pick is None:
        return None
    ones = [s[g][a] for g, a in pick.items()]
    ones += [e[row_of[pick[g]], col_of[pick[h]]] for (g, h, _), (e, row_of, col_of) in zip(reduced.edges, products)]
    return np.array(ones)


def _smallest_peak(problem, reduced, *, backend, time_limit_s, workers) -> float:
    """The lowest peak any plan reaches: the min-peak program over every memory row."""
    rows = reduced.rows
    groups = sorted({g for _, terms in rows for g in terms})
    if not groups:
        return max(r[0] for r in rows)
    _, mem_scale = _scales(reduced, [], rows, backend=backend)
    program = _Program()
    s = _add_one_hot(program, groups, reduced.costs, 0.0)
    _add_peak_rows(program, rows, s, mem_scale, integer=backend == "cpsat")
    outcome = _run(program, backend=backend, time_limit_s=time_limit_s, relative_gap=0.0, workers=workers)
    if outcome.values is None:
        raise SolverTimeoutError(
            f"no plan fits memory_limit, and the {backend} solver found no plan at all within "
            f"time_limit_s={time_limit_s} while looking for the smallest peak; raise time_limit_s"
        )
    return problem.peak_of(_choice_of(problem, reduced, _decode(outcome.values, s)))


def _unconstrained(reduced: _Reduced, groups: list[int], decided: dict[int, int], problem) -> np.ndarray | None:
    """The optimum ignoring memory rows, by variable elimination (None: graph too entangled);
    among plans of the same cost it prefers less memory (:func:`_less_memory_on_ties`)."""
    local = {g: i for i, g in enumerate(groups)}
    picked = eliminate([reduced.costs[g] for g in groups],
                       [(local[g], local[h], m) for g, h, m in reduced.edges])
    if picked is None:
        return None
    chosen = {g: int(picked[i]) for g, i in local.items()}
    _less_memory_on_ties(reduced, chosen)
    return _choice_of(problem, reduced, {**decided, **chosen})


def _group_memory(reduced: _Reduced, g: int) -> np.ndarray:
    """Bytes per strategy of group ``g`` summed over the memory rows (its tie-breaker)."""
    return sum((terms[g] for _, terms in reduced.rows if g in terms), np.zeros(len(reduced.costs[g])))


def _cheapest(time: np.ndarray, memory: np.ndarray) -> int:
    """The strategy of least ``memory`` among those of least ``time``."""
    near = np.flatnonzero(time == time.min())
    return int(near[np.argmin(memory[near])])


def _less_memory_on_ties(reduced: _Reduced, chosen: dict[int, int]) -> None:
    """Move single groups to strategies that cost no more time (up to rounding, 1e-12 of the
    plan's cost) and need fewer bytes summed over the memory rows, until none is left."""
    incident: dict[int, list] = {g: [] for g in chosen}
    for g, h, m in reduced.edges:
        incident[g].append((h, m))
        incident[h].append((g, m.T))
    memory = {g: _group_memory(reduced, g) for g in chosen}
    scale = sum(float(reduced.costs[g][a]) for g, a in chosen.items()) + sum(
        float(m[chosen[g], chosen[h]]) for g, h, m in reduced.edges)
    tolerance = 1e-12 * scale
    moved = True
    while moved:
        moved = False
        for g, a in chosen.items():
            if not memory[g].any():
                continue
            time = reduced.costs[g] + sum((m[:, chosen[h]] for h, m in incident[g]), np.zeros(len(memory[g])))
            near = np.flatnonzero(time <= time[a] + tolerance)
            best = int(near[np.argmin(memory[g][near])])
            if memory[g][best] < memory[g][a]:
                chosen[g] = best
                moved = True


def _fmt_bytes(b: float) -> str:
    """``3.200 GiB``, ``512.0 MiB``, ``90 bytes``: readable at any scale (limits may be tiny)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.{3 if unit == 'GiB' else 1}f} {unit}"
    return f"{b:.0f} bytes"


def _raise_infeasible(problem: ILPProblem, peak: float) -> None:
    limit = problem.memory_limit
    over = peak - limit
    ratio = f" ({peak / limit:.2f}× the limit)" if limit > 0 else ""
    raise InfeasibleError(
        f"no plan fits the memory limit of {_fmt_bytes(limit)} per device: the smallest achievable "
        f"peak is {_fmt_bytes(peak)} ({peak:.0f} bytes), {_fmt_bytes(over)} over{ratio}. Use more devices, a larger "
        "memory fraction, or let the search shard parameters/optimizer state (ZeRO/FSDP) and "
        "recompute activations.",
        smallest_peak=peak,
    )


def solve_ilp(
    problem: ILPProblem,
    *,
    time_limit_s: float = 30.0,
    backend: str = "highs",
    relative_gap: float = 1e-4,
    cpsat_workers: int = 8,
) -> ILPSolution:
    """Pick one strategy per node minimising total cost under the memory limit.

    Returns the best plan found within ``time_limit_s`` (``optimal`` False and ``gap`` > the
    requested one when the limit stopped the search). The search starts from each node's
    cheapest strategy when that plan fits the memory limit, so then a plan always comes back.
    Raises :class:`InfeasibleError` (with ``smallest_peak``, found by a second solve with the
    same time limit) when no plan fits and :class:`SolverTimeoutError` when no plan was found
    in time. ``cpsat_workers`` is CP-SAT's worker count (HiGHS picks its own threads).
    """
    if backend not in BACKENDS:
        raise SolverInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    workers = cpsat_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SolverInputError(f"cpsat_workers must be a positive integer, got {workers!r}")
    if not time_limit_s > 0 or not 0 <= relative_gap < 1:
        raise SolverInputError(f"need time_limit_s > 0 and 0 ≤ relative_gap < 1, got {time_limit_s}, {relative_gap}")
    start = time.perf_counter()
    reduced = _presolve(problem)
    limit = problem.memory_limit

    def infeasible():
        peak = _smallest_peak(problem, reduced, backend=backend, time_limit_s=time_limit_s, workers=workers)
        _raise_infeasible(problem, peak)

    binding = [r for r in reduced.rows if limit is not None and _row_max(r) > limit]
    if any(r[0] > limit for r in binding):  # some row is over the limit whatever is chosen
        infeasible()
    linked = {g for g, h, _ in reduced.edges} | {h for _, h, _ in reduced.edges}
    linked |= {g for _, terms in binding for g in terms}
    free = sorted(g for g in range(len(reduced.costs)) if g not in reduced.fixed)
    decided = {g: _cheapest(reduced.costs[g], _group_memory(reduced, g)) for g in free if g not in linked}
    groups = [g for g in free if g in linked]

    def solution(choice, *, optimal, gap, status, backend_name, num_vars=0, num_rows=0):
        return ILPSolution(
            choice=choice, objective=problem.objective_of(choice), peak_memory=problem.peak_of(choice),
            optimal=optimal, gap=gap, status=status, solve_time_s=time.perf_counter() - start,
            num_variables=num_vars, num_constraints=num_rows, backend=backend_name,
        )

    if not groups:
        choice = _choice_of(problem, reduced, decided)
        return solution(choice, optimal=True, gap=0.0, status="trivial", backend_name="none")
    free_choice = _unconstrained(reduced, groups, decided, problem)
    if free_choice is not None and (limit is None or problem.peak_of(free_choice) <= limit):
        # The optimum without memory rows fits them: it is the optimum with them.
        return solution(free_choice, optimal=True, gap=0.0, status="optimal", backend_name="elimination",
                        num_vars=sum(len(reduced.costs[g]) for g in groups))
    cost_scale, mem_scale = _scales(reduced, groups, binding, backend=backend)
    cpsat = backend == "cpsat"
    program = _Program()
    s = _add_one_hot(program, groups, reduced.costs, cost_scale)
    products = _add_edge_marginals(program, reduced.edges, s, cost_scale, integer=cpsat)
    _add_memory_rows(program, binding, s, limit, mem_scale)
    hint = _greedy_hint(reduced, s, products, binding, limit)
    outcome = _run(
        program, backend=backend, time_limit_s=time_limit_s, relative_gap=relative_gap, workers=workers, hint=hint
    )
    if outcome.infeasible:
        infeasible()
    if outcome.values is None and hint is not None:  # the solver ran out of time before beating the hint
        outcome.values = np.zeros(program.num_vars)
        outcome.values[hint] = 1.0
    if outcome.values is None:
        raise SolverTimeoutError(
            f"the {backend} solver found no plan within time_limit_s={time_limit_s} "
            f"({program.num_vars} variables, {program.num_rows} constraints; {outcome.detail}). Raise "
            "time_limit_s, or give the solver a smaller graph (fold followers, tie repeated layers)."
        )
    decided.update(_decode(outcome.values, s))
    choice = _choice_of(problem, reduced, decided)
    objective = problem.objective_of(choice)
    # The decided-in-presolve part adds the same amount to the objective and to its bound.
    fixed_part = reduced.offset + sum(float(reduced.costs[g][a]) for g, a in decided.items() if g not in s)
    bound = outcome.dual_bound / cost_scale + fixed_part if math.isfinite(outcome.dual_bound) else -math.inf
    gap = max(0.0, objective - bound) / objective if objective > 0 else 0.0
    optimal = outcome.proved or gap <= relative_gap
    return solution(
        choice, optimal=optimal, gap=gap, status="optimal" if optimal else "time_limit",
        backend_name=backend, num_vars=program.num_vars, num_rows=program.num_rows,
    )
