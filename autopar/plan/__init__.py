"""The Plan (frozen data with a JSON round trip) and what shows it: summary, explain, render,
and the sharding assignment code generation reads from it."""

from autopar.plan.data import (
    PHASES,
    SCHEMA_VERSION,
    Alternative,
    CollectiveRecord,
    MemoryBreakdown,
    NodeChoice,
    Plan,
    SolverStats,
    Stage,
    TimeBreakdown,
)

__all__ = ["PHASES", "SCHEMA_VERSION", "Alternative", "CollectiveRecord", "MemoryBreakdown",
           "NodeChoice", "Plan", "SolverStats", "Stage", "TimeBreakdown"]
