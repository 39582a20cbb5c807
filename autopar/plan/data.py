"""The Plan: what autopar decided for a model on a cluster, as frozen data with a JSON round trip.

A Plan holds the cluster and options it was made for (a :class:`Cluster` and an
:class:`Options`), the logical mesh, one strategy per planned graph node, where every parameter
and user input lives (``"S(0)"``/``"R"`` per mesh axis), every collective the program will
issue, and the predicted step time and peak memory with their breakdowns. It is plain data: it
saves to JSON (never pickle), loads back equal, and ``compile(..., plan=...)`` runs it.

    plan.save("plan.json"); same = Plan.load("plan.json"); assert same == plan
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autopar.core.errors import PlanError, ShardingError
from autopar.core.options import SCHEDULES, Options
from autopar.core.placement import parse_placement
from autopar.core.precision import PRECISIONS, named
from autopar.cost_models.cluster import Cluster
from autopar.plan.explain import explain
from autopar.plan.files import write_text
from autopar.plan.render import render
from autopar.plan.report import summarize
from autopar.plan.zero import LEVELS

SCHEMA_VERSION = 2  # 2: options and cluster are typed records (Options, Cluster), not free dicts
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective of the program: its kind, mesh axes, bytes per rank, phase and node."""

    kind: str
    axes: tuple[int, ...]
    nbytes: float
    phase: str
    node: str
    time: float

    def __post_init__(self):
        if self.phase not in PHASES:
            raise PlanError(f"collective phase must be one of {PHASES}, got {self.phase!r}")
        object.__setattr__(self, "axes", tuple(self.axes))


@dataclass(frozen=True)
class Alternative:
    """A strategy the solver could have picked for a node, and what that node alone switching to
    it would change: its own seconds, and the step time and device memory with every other
    node's choice held fixed (resharding on its edges included)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    compute_time: float
    communication_time: float
    step_time_delta: float
    memory_delta: float

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    @property
    def strategy(self) -> str:
        return _strategy_text(self.inputs, self.outputs)


def _strategy_text(inputs, outputs) -> str:
    ins = " ".join(f"[{s}]" for s in inputs)
    outs = " ".join(f"[{s}]" for s in outputs)
    return f"{ins} -> {outs}"


@dataclass(frozen=True)
class NodeChoice:
    """The strategy chosen for one graph node and what it costs (``flops``: the whole op's forward
    and backward FLOPs; ``activation_memory``: bytes per device kept for backward;
    ``top_alternatives``: the next-best strategies, see :class:`Alternative`)."""

    node: str
    op: str
    module: str | None
    layer: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    compute_time: float
    communication_time: float = 0.0
    alternatives: int = 1
    flops: float = 0.0
    forward_compute_time: float = 0.0
    activation_memory: float = 0.0
    top_alternatives: tuple[Alternative, ...] = ()
    local: str | None = None  # the rule's local implementation each rank runs (None: the op)

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "top_alternatives", tuple(
            a if isinstance(a, Alternative) else Alternative(**a) for a in self.top_alternatives))

    @property
    def strategy(self) -> str:
        return _strategy_text(self.inputs, self.outputs)


@dataclass(frozen=True)
class TimeBreakdown:
    """Predicted seconds per training step."""

    compute: float
    communication: float
    resharding: float
    bubble: float = 0.0
    offload: float = 0.0  # the offloaded optimizer step: gradients down, parameters up, the CPU step

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.resharding + self.bubble + self.offload


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak bytes on the worst device, by what they hold at that moment: model states,
    ``activations`` (the inputs, and what forward saved for backward), ``temporaries``
    (intermediates and activation gradients) and ``communication`` (collectives' own buffers)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    temporaries: float = 0.0
    communication: float = 0.0

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.temporaries
                + self.communication)


@dataclass(frozen=True)
class SolverStats:
    """How the plan was found."""

    method: str
    status: str = "n/a"
    optimal: bool = True
    gap: float = 0.0
    solve_time_s: float = 0.0
    graph_nodes: int = 0
    solver_nodes: int = 0
    num_variables: int = 0
    num_constraints: int = 0


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous range of the model on a sub-mesh of the cluster.

    ``layers`` are the repeated layers it runs (as captured; empty for a graph without repeated
    layers); ``has_pre`` / ``has_post`` whether it also runs the part before the first layer
    (embeddings) / after the last (head, loss); ``nodes`` the graph nodes it computes, in graph
    order. ``ranks`` are the global ranks of its sub-mesh, row-major over ``mesh_shape``, its
    logical mesh ``(dp, tp)``: the :class:`NodeChoice` of each of its nodes in ``Plan.nodes``
    is a strategy on that mesh, and ``parameter_placements`` / ``input_placements`` hold its
    parameters' storage and its user inputs' placement on it. ``zero`` is the ZeRO stage over
    the ``dp`` axis (0, 1, 2 or 3), ``recompute`` whether its layers recompute their forward in
    backward (True) or the cheap runs between their matmuls (``"selective"``). ``time``: seconds per micro-batch (forward, backward, its share of gradient
    synchronisation, the send to the next stage); ``memory``: peak bytes per device with
    ``in_flight`` micro-batches of activations held under the schedule, and ``breakdown`` that
    peak split by kind (None in plans saved before stages recorded it); ``flops_per_device``:
    FLOPs one of its devices executes per step (see :attr:`Plan.flops_per_device`);
    ``collective_records``: the collectives each of its ranks issues per step, sends to the
    neighbouring stages on mesh axis -1 (:mod:`autopar.plan.stage_records`; None: not recorded).
    """

    index: int
    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    layers: tuple[str, ...]
    has_pre: bool
    has_post: bool
    nodes: tuple[str, ...]
    parameter_placements: dict[str, tuple[str, ...]]
    input_placements: dict[str, tuple[str, ...]]
    time: float
    memory: float
    in_flight: int = 1
    zero: int = 0
    recompute: bool | str = False
    breakdown: MemoryBreakdown | None = None
    flops_per_device: float = 0.0
    collective_records: tuple[CollectiveRecord, ...] | None = None

    def __post_init__(self):
        if isinstance(self.breakdown, dict):
            object.__setattr__(self, "breakdown", MemoryBreakdown(**self.breakdown))
        if self.collective_records is not None:
            object.__setattr__(self, "collective_records", tuple(
                c if isinstance(c, CollectiveRecord) else CollectiveRecord(**c) for c in self.collective_records))
        if self.recompute not in (True, False, "selective"):
            raise PlanError(f"stage {self.index}: recompute must be True, False or 'selective', got {self.recompute!r}")
        for name in ("ranks", "mesh_shape", "layers", "nodes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("parameter_placements", "input_placements"):
            table = {k: tuple(v) for k, v in getattr(self, name).items()}
            object.__setattr__(self, name, table)
            for key, placements in table.items():
                if len(placements) != len(self.mesh_shape):
                    raise PlanError(f"stage {self.index}: {key!r} has {len(placements)} placements but"
                                    f" the stage mesh {self.mesh_shape} has {len(self.mesh_shape)} axes")
        size = 1
        for n in self.mesh_shape:
            size *= n
        if len(self.ranks) != size or len(set(self.ranks)) != size:
            raise PlanError(f"stage {self.index}: {len(self.ranks)} distinct ranks needed for mesh"
                            f" {self.mesh_shape}, got {self.ranks}")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"stage {self.index}: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.in_flight < 1:
            raise PlanError(f"stage {self.index}: in_flight must be ≥ 1, got {self.in_flight}")


def _check_placements(what, placements) -> None:
    """Raise PlanError unless every entry is a placement's text (``S(0)``, ``R``, ``P(sum)``)."""
    for text in placements:
        try:
            parse_placement(text)
        except (ShardingError, AttributeError):
            raise PlanError(f"{what} has placement {text!r}; a plan holds S(<dim>), R or P(sum):"
                            " re-create the plan (autopar.compile) rather than editing it") from None


@dataclass(frozen=True)
class Plan:
    """A parallel plan for one model on one cluster (see the module docstring)."""

    name: str
    cluster: Cluster
    mesh_shape: tuple[int, ...]
    fingerprint: str
    nodes: tuple[NodeChoice, ...]
    parameter_placements: dict[str, tuple[str, ...]]
    input_placements: dict[str, tuple[str, ...]]
    collective_records: tuple[CollectiveRecord, ...]
    time: TimeBreakdown
    memory: MemoryBreakdown
    flops_per_step: float
    solver: SolverStats
    options: Options = field(default_factory=Options)
    precision: str = "fp32"  # what the program computes in (autopar.core.precision.PRECISIONS)
    # FLOPs the busiest device executes per step as torch's FlopCounterMode counts them (matmuls,
    # convolutions, attention; recomputation included): what verify measures. 0: not predicted
    flops_per_device: float = 0.0
    # FQN -> (parameter, gradient, optimizer-state) bytes per device
    parameter_memory: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # pipeline: stages in pipeline order (empty: one program on the whole mesh), micro-batches
    # per step, schedule ("1f1b" or "gpipe"), and the idle share of device-time in a step
    stages: tuple[Stage, ...] = ()
    # one-program plans: the ZeRO stage of the parameters stored whole on data-parallel axes (0, 1
    # or 2, autopar.plan.zero; ZeRO-3 is parameters placed sharded); pipelined plans: Stage.zero
    zero: int = 0
    # one-program plans: every repeated layer recomputes its forward in backward (torch's
    # checkpoint, autopar.runtime.recompute), or with "selective" the runs between its matmuls
    # (autopar.core.recompute); pipelined plans: Stage.recompute
    recompute: bool | str = False
    # one-program plans: the optimizer's state, masters and step live on the host (ZeRO-Offload,
    # autopar.planner.offload), which holds ``host_memory`` bytes per device at its peak
    offload: bool = False
    host_memory: float = 0.0
    # one-program plans with ``offload``: the parameters live on the host too and are fetched per
    # layer with prefetch, their gradients sent back as made (ZeRO-Infinity, autopar.planner.fetched)
    offload_parameters: bool = False
    # with ``offload_parameters``: linears and embeddings too large for a device run tile by tile
    # from their weight on the host (node name -> tiles; autopar.planner.tiling)
    tiles: dict[str, int] = field(default_factory=dict)
    # one-program plans with full recompute: the layers' checkpoints wait on the host between
    # forward and backward (autopar.runtime.recompute.CheckpointHost)
    offload_activations: bool = False
    # why the planner made its memory decisions (ZeRO, offload), one sentence each, with what the
    # alternative would have been
    why: tuple[str, ...] = ()
    micro_batches: int = 1
    schedule: str | None = None
    bubble_fraction: float = 0.0
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if not isinstance(self.cluster, Cluster):
            raise PlanError(f"Plan.cluster must be a Cluster, got {type(self.cluster).__name__}:"
                            " pass the Cluster the plan was made for (Plan.from_dict reads a saved one)")
        if not isinstance(self.options, Options):
            raise PlanError(f"Plan.options must be an Options, got {type(self.options).__name__}:"
                            " pass the Options the plan was made with (Plan.from_dict reads saved ones)")
        object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "collective_records", tuple(self.collective_records))
        object.__setattr__(self, "why", tuple(self.why))
        object.__setattr__(self, "stages", tuple(s if isinstance(s, Stage) else Stage(**s) for s in self.stages))
        if self.zero not in LEVELS or (self.zero and self.stages):
            raise PlanError(f"zero must be one of {LEVELS} for a one-program plan (a pipelined plan's stages hold"
                            f" their own), got {self.zero!r}")
        if self.recompute not in (True, False, "selective") or (self.recompute and self.stages):
            raise PlanError(f"recompute must be True, False or 'selective' for a one-program plan (a pipelined"
                            f" plan's stages hold their own), got {self.recompute!r}")
        if self.offload not in (True, False) or (self.offload and (self.stages or self.cluster.host is None)):
            raise PlanError(f"offload must be True or False, and True only for a one-program plan on a cluster"
                            f" whose host is described (Cluster.host), got {self.offload!r}")
        fetching = self.offload_parameters
        if fetching not in (True, False) or (fetching and (not self.offload or self.zero)):
            raise PlanError(f"offload_parameters must be True or False, and True only with offload (the optimizer on"
                            f" the host) at ZeRO 0, got {self.offload_parameters!r}")
        if self.tiles and (not fetching or not all(isinstance(k, int) and k > 1 for k in self.tiles.values())):
            raise PlanError(f"tiles must map node names to tile counts above 1, and only in a plan whose parameters are"
                            f" offloaded (offload_parameters), got {self.tiles!r}")
        if self.offload_activations not in (True, False) or (self.offload_activations and (
                self.recompute is not True or self.cluster.host is None or fetching)):
            raise PlanError(f"offload_activations must be True or False, and True only for a fully recomputing"
                            f" one-program plan (recompute=True) whose parameters stay on the devices, on a cluster"
                            f" whose host is described, got {self.offload_activations!r}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise PlanError(f"micro_batches must be a positive int, got {self.micro_batches!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {SCHEDULES} or None, got {self.schedule!r}")
        if self.stages:
            ranks = sorted(r for st in self.stages for r in st.ranks)
            if ranks != list(range(self.num_devices)):
                raise PlanError(f"the stages' ranks must cover ranks 0..{self.num_devices - 1} once each")
        for table in (self.parameter_placements, self.input_placements):
            for key, placements in table.items():
                if len(placements) != len(self.mesh_shape):
                    raise PlanError(
                        f"{key!r} has {len(placements)} placements but the mesh has"
                        f" {len(self.mesh_shape)} axes"
                    )
                _check_placements(repr(key), placements)
        texts: dict[str, str] = {}  # each sharding's text -> the first node with it (layers repeat them)
        for n in self.nodes:
            for sharding in n.inputs + n.outputs:
                if isinstance(sharding, str):
                    texts.setdefault(sharding, n.node)
                else:
                    _check_placements(f"node {n.node!r}", [sharding])
        for sharding, node in texts.items():
            _check_placements(f"node {node!r}", sharding.split(","))
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.flops_per_step > 0 and self.time.total * self.peak_flops < self.flops_per_step * (1 - 1e-9):
            raise PlanError(
                f"the plan claims a step of {self.time.total:.4g} s for {self.flops_per_step:.4g} FLOPs on"
                f" {self.num_devices} x {self.peak_flops / self.num_devices:.4g} FLOP/s ({self.precision}):"
                f" {self.mfu:.0%} MFU, and no plan beats 100 %. The device's efficiencies or the FLOP counts"
                " it was costed with are wrong: re-calibrate (autopar profile) and re-plan")

    # --- what users read -------------------------------------------------------------
    @property
    def predicted_step_time(self) -> float:
        """Seconds per training step."""
        return self.time.total

    @property
    def predicted_peak_memory(self) -> float:
        """Bytes on the worst device."""
        return self.memory.total

    @property
    def num_devices(self) -> int:
        """Ranks the plan runs on."""
        n = 1
        for size in self.mesh_shape:
            n *= size
        return n

    @property
    def peak_flops(self) -> float:
        """The cluster's FLOP/s in the precision the plan computes in (all devices)."""
        return self.num_devices * self.cluster.device_spec.peak(named(self.precision).peak_dtype)

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: useful FLOPs per second over the cluster's peak in the plan's
        precision (one-stage and pipelined plans alike; at most 1, see ``__post_init__``)."""
        if self.predicted_step_time <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.flops_per_step / self.predicted_step_time / self.peak_flops

    def collectives(self, *, phase: str | None = None) -> list[CollectiveRecord]:
        """Every collective of a step, optionally of one phase."""
        return [c for c in self.collective_records if phase is None or c.phase == phase]

    def node(self, name: str) -> NodeChoice:
        for n in self.nodes:
            if n.node == name:
                return n
        raise PlanError(f"the plan has no node {name!r}")

    def summary(self) -> str:
        return summarize(self)

    def explain(self, target: str, *, top: int | None = None) -> str:
        """The strategies the solver weighed for the nodes of a module (or one node) and what
        each would have cost: see :func:`autopar.plan.explain.explain`."""
        return explain(self, target, top=top)

    def render(self, path) -> str:
        """Draw the plan to ``path`` (``.html`` or ``.png``): see :func:`autopar.plan.render.render`."""
        return render(self, path)

    # --- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON-ready data; :meth:`from_dict` reads it back equal."""
        out = asdict(self)
        out["cluster"] = self.cluster.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError("a plan file must hold a JSON object")
        version = data.get("schema_version")
        if isinstance(version, int) and version < SCHEMA_VERSION:
            raise PlanError(
                f"this plan was saved by an older autopar (plan schema version {version}; this one reads"
                f" version {SCHEMA_VERSION}, which stores the options and cluster as typed records) and"
                " cannot be read: re-plan with autopar.compile(model, cluster, ...) and save it again"
            )
        if version != SCHEMA_VERSION:
            raise PlanError(
                f"plan schema version {version!r} is not the one this autopar reads"
                f" ({SCHEMA_VERSION}); re-plan with this version or upgrade autopar"
            )
        try:
            kwargs: dict[str, Any] = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            kwargs["cluster"] = Cluster.from_dict(data["cluster"])
            kwargs["options"] = Options(**data["options"])
            kwargs.setdefault("precision", "mixed" if kwargs["options"].mixed_precision else "fp32")  # older files
            kwargs["nodes"] = tuple(NodeChoice(**n) for n in data["nodes"])
            kwargs["collective_records"] = tuple(CollectiveRecord(**c) for c in data["collective_records"])
            kwargs["time"] = TimeBreakdown(**data["time"])
            kwargs["memory"] = MemoryBreakdown(**data["memory"])
            kwargs["solver"] = SolverStats(**data["solver"])
            for key in ("parameter_placements", "input_placements"):
                kwargs[key] = {k: tuple(v) for k, v in data[key].items()}
            kwargs["parameter_memory"] = {k: tuple(v) for k, v in data.get("parameter_memory", {}).items()}
            return cls(**kwargs)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"plan data is malformed ({type(exc).__name__}: {exc}); re-create it with plan.save") from exc

    def save(self, path) -> None:
        """Write the plan as JSON atomically (a crash leaves the old file or none, never half),
        with the permissions of any new file (0644 under umask 022)."""
        write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path) -> "Plan":
        """Read a plan saved by :meth:`save`; a corrupt or foreign file raises PlanError."""
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError as exc:
            raise PlanError(f"no plan file at {path}") from exc
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path} is not a valid plan file (bad JSON at line {exc.lineno}); re-save it") from exc
        except UnicodeDecodeError:
            raise PlanError(f"{path} is not a valid plan file (binary, not JSON: plans are JSON, never"
                            " pickle); re-save it with plan.save") from None
        return cls.from_dict(data)
