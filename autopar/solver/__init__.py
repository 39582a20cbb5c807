"""The planner's two optimisers, numpy in and numpy out.

:mod:`autopar.solver.ilp` picks one sharding strategy per node (an integer linear program on
OR-Tools; its data in :mod:`~autopar.solver.problem`, its presolve, program, backends,
infeasibility diagnosis, memory-free elimination, the relaxed problem's floor, the
Lagrangian search under one memory row and the single-group moves both improve plans by, in
:mod:`~autopar.solver.presolve`, :mod:`~autopar.solver.program`, :mod:`~autopar.solver.backends`,
:mod:`~autopar.solver.infeasible`, :mod:`~autopar.solver.eliminate`,
:mod:`~autopar.solver.relaxed`, :mod:`~autopar.solver.lagrange` and :mod:`~autopar.solver.moves`);
:mod:`autopar.solver.stages` splits pipeline units into stages on sub-meshes (a dynamic
program). :mod:`autopar.solver.brute_force` enumerates small cases for the tests.
"""

from autopar.solver.ilp import solve_ilp
from autopar.solver.problem import ILPProblem, ILPSolution, MemoryRow
from autopar.solver.stages import StagePlan, solve_stages

__all__ = [
    "ILPProblem",
    "ILPSolution",
    "MemoryRow",
    "StagePlan",
    "solve_ilp",
    "solve_stages",
]
