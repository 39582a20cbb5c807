"""The planner's two optimisers, numpy in and numpy out.

:mod:`autopar.solver.ilp` picks one sharding strategy per node (an integer linear program on
OR-Tools); :mod:`autopar.solver.stages` splits pipeline units into stages on sub-meshes (a
dynamic program). :mod:`autopar.solver.brute_force` enumerates small cases for the tests.
"""

from autopar.solver.ilp import ILPProblem, ILPSolution, MemoryRow, solve_ilp
from autopar.solver.stages import StagePlan, solve_stages

__all__ = [
    "ILPProblem",
    "ILPSolution",
    "MemoryRow",
    "StagePlan",
    "solve_ilp",
    "solve_stages",
]
