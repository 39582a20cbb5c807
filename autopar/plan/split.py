"""Split a captured training graph into pipeline stages, one GraphModule each.

:func:`split_stages` cuts the graph by ``Stage.nodes`` of a pipelined :class:`~autopar.plan.Plan`
(the graph must be captured at the micro-batch size, so its node names are the plan's). Stage
``k`` receives, as its leading placeholders, every value an earlier stage produced that stage
``k`` or a later one reads (a value that skips stages, e.g. an attention mask built in the pre
part, passes through the stages between), followed by the parameters, buffers and constants its
own nodes read. Stage 0 receives the user inputs (the pipeline's root arguments). Every stage
but the last returns the values later stages read; the last returns the loss.

Each boundary value travels in a *boundary sharding* on each stage's own ``(dp, tp)`` mesh: split
on ``dp`` along its batch dim when that mesh has ``dp > 1`` and the dim divides, else replicated,
and replicated on every other axis. The batch dim is the producer's ``dp`` placement when it is a
shard; where the producing stage has no ``dp`` (or a user input passes a stage with none), a
consumer's on a stage that has one. Code generation reshards to it before the send and from it
after the receive, so stages may shard a value differently; between stages of different meshes
the runtime moves the blocks each receiver lacks (:mod:`autopar.core.crossmesh`).

**The loss over micro-batches** (:class:`LossSplit`): the loss of one step must be the mean over
the whole batch. When the loss is ``sum / count`` with a count computed from the inputs only
(how capture writes mean cross entropy), the last stage takes the count as a placeholder and the
runtime feeds the count of the whole batch, computed before the schedule runs
(:func:`count_program`): the micro-batch losses then add up to the global mean exactly. A loss
that is a mean over the batch (``reduction="mean"``, ``aten.mean``) is divided by the number of
micro-batches (micro-batches are equal); a sum over the batch is kept. Casts, negation and
scaling by a constant on top of these change nothing. Any other loss needs a single micro-batch.

The split is pure graph partitioning, shared by code generation
(:func:`autopar.passes.codegen.split.generate_stage` emits each stage's rank programs) and the
plan's per-stage collective records (:mod:`autopar.plan.stage_records`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import PipelineError
from autopar.core.ir import Strategy, copy_graph_module, gradient_values, tensor_inputs
from autopar.core.placement import R, Shard, local_shape, parse_placement, parse_sharding
from autopar.plan.annotate import annotate_pass
from autopar.plan.gradients import gradient_pass
from autopar.plan.stored import Stored

aten = torch.ops.aten
# casts and scalings by a constant: a loss made of one of these over a mean adds up like the mean
_LINEAR = {aten._to_copy.default, aten.neg.default, aten.mul.Scalar, aten.div.Scalar}
_MEAN_OPS = {aten.mean.default, aten.mean.dim}
_SUM_OPS = {aten.sum.default, aten.sum.dim_IntList}


@dataclass(frozen=True)
class Boundary:
    """A value sent between stages: its node name, global (micro-batch) shape, dtype, boundary
    sharding and whether it carries a gradient."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharding: tuple
    requires_grad: bool

    def local_shape(self, mesh_shape) -> tuple[int, ...]:
        return local_shape(self.shape, self.sharding, mesh_shape)


@dataclass(frozen=True)
class LossSplit:
    """How the last stage's loss adds up over micro-batches (module docstring): ``kind`` is
    ``"count"`` (``count`` names the node replaced by the whole batch's count), ``"mean"``
    (divide by the number of micro-batches) or ``"sum"``."""

    kind: str
    node: str
    count: str | None = None

    def __post_init__(self):
        if self.kind not in ("count", "mean", "sum"):
            raise PipelineError(f"loss kind must be count, mean or sum, got {self.kind!r}")


@dataclass(eq=False)
class StageGraph:
    """One stage's graph and what its placeholders and outputs are (module docstring)."""

    index: int
    mesh_shape: tuple[int, ...]
    graph_module: torch.fx.GraphModule
    inputs: tuple[Boundary, ...]  # leading placeholders: received (stage 0: the user inputs)
    input_shardings: tuple[tuple, ...]  # how the program takes them (stage 0: the plan's)
    stored: tuple[Stored, ...]  # then these placeholders
    count: str | None  # then this one (the last stage under LossSplit "count")
    outputs: tuple[Boundary, ...]  # empty for the last stage, which returns the loss
    assignment: ShardingAssignment

    @property
    def trainable(self) -> frozenset:
        names = {s.node for s in self.stored if s.trainable}
        return frozenset(names | {b.name for b in self.inputs if b.requires_grad})

    @property
    def differentiated(self) -> tuple[int, ...]:
        """The outputs backward starts from: the loss, or the boundary values carrying a gradient."""
        return (0,) if not self.outputs else tuple(i for i, b in enumerate(self.outputs) if b.requires_grad)


def analysed_stage(stage: StageGraph) -> torch.fx.GraphModule:
    """A copy of ``stage``'s graph after code generation's analysis (the annotate and gradient
    passes): every edge's steps and backward, boundary outputs differentiated like losses."""
    def ctx(loss_outputs):
        return SimpleNamespace(assignment=stage.assignment, trainable=stage.trainable, loss_outputs=loss_outputs)

    gm = annotate_pass(copy_graph_module(stage.graph_module), ctx(() if stage.outputs else (0,)))
    return gradient_pass(gm, ctx(stage.differentiated))


def _strategies(plan) -> dict[str, Strategy]:
    return {n.node: Strategy(tuple(parse_sharding(s) for s in n.inputs),
                             tuple(parse_sharding(s) for s in n.outputs), n.local) for n in plan.nodes}


def _strip_linear(node: torch.fx.Node) -> torch.fx.Node:
    while node.op == "call_function" and node.target in _LINEAR:
        node = node.args[0]
    return node


def _reduction(node: torch.fx.Node):
    """The ``reduction`` argument of a loss op (None when the op has none)."""
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name == "reduction":
            return node.args[i] if i < len(node.args) else node.kwargs.get("reduction", arg.default_value)
    return None


def _is_sum(node: torch.fx.Node) -> bool:
    scalar = isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 0
    return scalar and (node.target in _SUM_OPS or _reduction(node) == 2)


def _is_mean(node: torch.fx.Node) -> bool:
    scalar = isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 0
    return scalar and (node.target in _MEAN_OPS or _reduction(node) == 1)


def _ancestors(node: torch.fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def loss_split(captured, *, micro_batches: int) -> LossSplit:
    """How the loss adds up over ``micro_batches`` (module docstring); PipelineError if it cannot."""
    names = [o.node for o in captured.outputs if o.kind == "loss"]
    if not names:
        raise PipelineError("the captured model returns no loss: capture it with its labels or a loss_fn")
    nodes = {n.name: n for n in captured.graph_module.graph.nodes}
    loss = nodes[names[0]]
    if micro_batches == 1:
        return LossSplit("sum", loss.name)
    kinds = {i.node: i.kind for i in captured.inputs}
    core = _strip_linear(loss)
    if core.target is aten.div.Tensor and all(isinstance(a, torch.fx.Node) for a in core.args[:2]):
        total, count = _strip_linear(core.args[0]), core.args[1]
        sources = {kinds[a.name] for a in _ancestors(count) if a.op == "placeholder"}
        if _is_sum(total) and "user_input" in sources and sources <= {"user_input", "constant"}:
            return LossSplit("count", loss.name, count.name)
    if _is_mean(core):
        return LossSplit("mean", loss.name)
    if _is_sum(core):
        return LossSplit("sum", loss.name)
    raise PipelineError(
        f"the loss ({core.target}) is neither a mean nor a sum over the batch, so the losses of"
        f" {micro_batches} micro-batches do not add up to it: write the loss as a mean or sum over"
        " the batch, or plan with micro_batches=1")


def count_program(captured, count: str) -> torch.fx.GraphModule:
    """A program from the user inputs (all of them, in order) to node ``count``, run on the
    whole batch before the schedule (``captured`` is the whole-batch capture)."""
    graph = captured.graph_module.graph
    node = next(n for n in graph.nodes if n.name == count)
    need = _ancestors(node)
    users = {i.node for i in captured.inputs if i.kind == "user_input"}
    out = torch.fx.Graph()
    env = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in users:
            env[n] = out.placeholder(n.name)
        elif n in need:
            if n.op == "placeholder":
                raise PipelineError(f"the loss's count reads {n.name}, which is not a user input")
            env[n] = out.node_copy(n, lambda a: env[a])
    out.output(env[node])
    return torch.fx.GraphModule(captured.graph_module, out)


def _live(loss: torch.fx.Node, count: str | None) -> set:
    """The nodes the loss needs; the count node stands in for its inputs (it is fed)."""
    seen, todo = set(), [loss]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.name != count:
            todo.extend(n.all_input_nodes)
    return seen


def _produced_dp(node, strategies, user_dp) -> object:
    """The producer's placement of ``node`` on mesh axis 0 (dp), or R."""
    if node.op == "placeholder":
        return user_dp.get(node.name, R)
    strat, index = strategies.get(node.name), 0
    if strat is None and node.target is operator.getitem:
        src, k = node.args
        strat = strategies.get(src.name)
        vals = src.meta.get("val")
        index = sum(1 for v in vals[:k] if isinstance(v, torch.Tensor)) if isinstance(vals, (tuple, list)) else 0
    if strat is None or index >= len(strat.outputs):
        return R
    return strat.outputs[index][0]


def _consumed_dp(node, strategies, stage_of, meshes) -> object:
    """A consumer's placement of ``node`` on mesh axis 0 on a stage with ``dp > 1``, or R."""
    for user in node.users:
        strat, k = strategies.get(user.name), stage_of.get(user.name)
        if strat is None or k is None or meshes[k][0] == 1:
            continue
        for x, sharding in zip(tensor_inputs(user), strat.inputs):
            if x is node and isinstance(sharding[0], Shard):
                return sharding[0]
    return R


def split_stages(captured, plan, *, loss: LossSplit, trainable) -> list[StageGraph]:
    """One :class:`StageGraph` per stage of ``plan`` (module docstring). ``captured`` is the
    micro-batch capture; ``trainable`` the FQNs of parameters that get gradients."""
    meshes = [tuple(st.mesh_shape) for st in plan.stages]
    gm = captured.graph_module
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    inputs = {i.node: i for i in captured.inputs}
    stage_of: dict[str, int] = {}
    for st in plan.stages:
        for name in st.nodes:
            if name not in by_name:
                raise PipelineError(f"stage {st.index} names node {name!r}, which the graph lacks: re-plan")
            stage_of[name] = st.index
    if stage_of.get(loss.node) != len(plan.stages) - 1:
        raise PipelineError(f"the loss ({loss.node}) is not computed by the last stage: re-plan")
    live = _live(by_name[loss.node], loss.count)
    for n in live:
        if n.op == "call_function" and n.name not in stage_of:
            raise PipelineError(f"node {n.name} is in no stage of the plan: re-plan this model")
    strategies = _strategies(plan)
    stored_dp = {}  # a user input's placement on dp where a stage with dp > 1 stores it
    for st in plan.stages:
        for name, places in st.input_placements.items():
            if st.mesh_shape[0] > 1:
                stored_dp.setdefault(name, parse_placement(places[0]))
    user_dp = {i.node: stored_dp.get(i.name, R) for i in captured.inputs if i.kind == "user_input"}
    reached = gradient_values(graph, {i.node for i in captured.inputs
                                      if i.kind == "parameter" and i.name in trainable})
    grad = {n: n.name in reached for n in graph.nodes}

    def boundary(n: torch.fx.Node, mesh) -> Boundary:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise PipelineError(f"{n.name} crosses a stage boundary but is not a tensor: re-plan")
        dp = _produced_dp(n, strategies, user_dp)
        if n.op != "placeholder" and meshes[stage_of[n.name]][0] == 1:
            dp = _consumed_dp(n, strategies, stage_of, meshes)
        split = isinstance(dp, Shard) and mesh[0] > 1 and val.shape[dp.dim] % mesh[0] == 0
        return Boundary(n.name, tuple(val.shape), val.dtype, ((dp if split else R),) + (R,) * (len(mesh) - 1),
                        grad[n])

    count_stage = len(plan.stages) - 1
    # the stage producing each value (-1: a user input, fed to stage 0) and the last stage reading it
    made: dict = {}
    last_use: dict = {}
    used_by: list[set] = [set() for _ in plan.stages]
    for n in graph.nodes:
        if n.op == "placeholder":  # parameters, buffers, constants: held by the stages reading them
            made[n] = -1 if inputs[n.name].kind == "user_input" else None
            continue
        if n not in live:
            continue
        if n.op != "call_function":
            continue
        k = stage_of[n.name]
        made[n] = k
        if n.name == loss.count:
            continue
        for a in n.all_input_nodes:
            used_by[k].add(a)
            if made.get(a) is not None:
                if made[a] > k:
                    raise PipelineError(f"{n.name} (stage {k}) reads {a.name} from the later stage {made[a]}: re-plan")
                last_use[a] = max(last_use.get(a, -1), k)
    order = [n for n in graph.nodes if n in last_use]
    carried = [[n for n in order if made[n] < k <= last_use[n]] for k in range(len(plan.stages))]
    carried[0] = [n for n in order if made[n] == -1]
    stages = []
    for st in plan.stages:
        k = st.index
        mesh = meshes[k]
        new = torch.fx.Graph()
        env: dict = {}
        received = [boundary(n, mesh) for n in carried[k]]
        for b in received:
            env[by_name[b.name]] = _placeholder(new, by_name[b.name])
        stored = []
        for n in graph.nodes:
            unused = k == 0 and n.op == "placeholder" and not any(n in u for u in used_by)
            if n.op == "placeholder" and made.get(n, -2) is None and (n in used_by[k] or unused):
                env[n] = _placeholder(new, n)
                info = inputs[n.name]
                places = st.parameter_placements.get(info.name) if info.kind == "parameter" else None
                sharding = tuple(parse_placement(p) for p in places) if places else (R,) * len(mesh)
                stored.append(Stored(n.name, info.kind, info.name, sharding,
                                          info.kind == "parameter" and info.name in trainable))
        count = None
        if loss.count is not None and k == count_stage:
            count = loss.count
            env[by_name[count]] = _placeholder(new, by_name[count])
        for n in graph.nodes:
            if n in live and n.op == "call_function" and stage_of[n.name] == k and n.name != loss.count:
                env[n] = new.node_copy(n, lambda a: env[a])
                if env[n].name != n.name:
                    raise PipelineError(f"node {n.name} was renamed {env[n].name} in stage {k}")
        last = k == len(plan.stages) - 1
        sends = [] if last else [boundary(n, mesh) for n in carried[k + 1]]
        out = new.output((env[by_name[loss.node]],) if last else tuple(env[by_name[b.name]] for b in sends))
        out.meta["val"] = tuple(a.meta.get("val") for a in out.args[0])
        shardings = tuple(_input_sharding(b, st, inputs, k) for b in received)
        placeholder_shardings = {b.name: s for b, s in zip(received, shardings)}
        placeholder_shardings.update({s.node: s.sharding for s in stored})
        if count is not None:
            placeholder_shardings[count] = (R,) * len(mesh)
        assignment = ShardingAssignment(
            mesh_shape=mesh,
            node_strategies={n.name: strategies[n.name] for n in env.values() if n.name in strategies},
            placeholder_shardings=placeholder_shardings,
            output_shardings=((R,) * len(mesh),) if last else tuple(b.sharding for b in sends))
        stages.append(StageGraph(k, mesh, torch.fx.GraphModule(gm, new), tuple(received), shardings,
                                 tuple(stored), count, tuple(sends), assignment))
    return stages


def _placeholder(graph: torch.fx.Graph, like: torch.fx.Node) -> torch.fx.Node:
    node = graph.placeholder(like.name)
    node.meta = dict(like.meta)
    if node.name != like.name:
        raise PipelineError(f"placeholder {like.name} was renamed {node.name}")
    return node


def _input_sharding(b: Boundary, stage, inputs, k: int) -> tuple:
    """Stage 0 takes a user input as the plan stores it there; other values in their boundary sharding."""
    info = inputs.get(b.name)
    if k == 0 and info is not None and info.name in stage.input_placements:
        return tuple(parse_placement(p) for p in stage.input_placements[info.name])
    return b.sharding


__all__ = ["Boundary", "LossSplit", "StageGraph", "analysed_stage", "count_program", "loss_split", "split_stages"]
