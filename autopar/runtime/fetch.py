"""Parameters on the host, fetched per layer (ZeRO-Infinity's parameter offload).

A rank whose plan offloads its parameters (``Plan.offload_parameters``) keeps every floating
parameter piece on the host; the device holds only the pieces of the layer running and of the
next one. :func:`fetch_parameters` rewrites a rank's program so that each run of one layer's nodes
(:func:`~autopar.runtime.recompute.layer_runs`; the embedding and the head are runs of their own)
starts with one :func:`autopar_fetch` of the parameters it reads::

    fetch = autopar_fetch((p_layers_1_w, ...), ahead=(p_layers_2_w, ...), behind=(p_layers_0_w, ...))
    fetch_0 = fetch[0] ...

The fetch copies the run's pieces to the device (or takes the copies made ahead) and starts the
copies of the next run's (``ahead``), on a side CUDA stream where the device is a GPU so that they
overlap the run's compute; after its last use in forward a copy is freed (autograd keeps a handle
instead: :func:`autopar.comm.regather.note`). In backward each piece is fetched again when its
node's backward first needs it, the previous run's (``behind``) prefetched, and each gradient is
copied to the host as soon as it is made (it accumulates in the host piece's ``.grad``). On CPU
ranks host and device are the same RAM: the copies are still made and freed as on a GPU.
"""

from __future__ import annotations

import copy
import operator
import warnings

import torch
from torch.autograd import Function

from autopar.comm.regather import note
from autopar.core.recompute import program_nodes
from autopar.runtime.tiles import tile_nodes, tiled_weight

class Fetcher:
    """Copies host pieces to ``device``; copies started ahead wait in a cache until taken."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._ahead: dict[tuple, tuple] = {}  # _key(host piece) -> (its copy, the copy's CUDA event or None)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def take(self, host: torch.Tensor) -> torch.Tensor:
        """``host``'s copy on the device: the one made ahead, else a new one."""
        entry = self._ahead.pop(_key(host), None)
        if entry is None:
            return host.to(self.device, copy=True)
        copy, event = entry
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            copy.record_stream(torch.cuda.current_stream(self.device))
        return copy

    def prefetch(self, hosts) -> None:
        """Start copying ``hosts`` (those not on their way already)."""
        for host in hosts:
            if _key(host) in self._ahead:
                continue
            if self._stream is None:
                self._ahead[_key(host)] = (host.to(self.device, copy=True), None)
                continue
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                copy = host.to(self.device, non_blocking=True, copy=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._ahead[_key(host)] = (copy, event)

    def again(self, host: torch.Tensor, behind) -> torch.Tensor:
        """``host`` fetched again in backward; the previous run's pieces (``behind``) prefetched."""
        copy = self.take(host)
        self.prefetch(behind)
        return copy

    def clear(self) -> None:
        """Drop the copies made ahead (a step's start)."""
        self._ahead.clear()


def _key(host: torch.Tensor) -> tuple:
    """A host piece's identity, the same for every alias of it (a recomputation's inputs are
    other tensor objects; ``id`` of a freed one is reused)."""
    return host.untyped_storage()._cdata, host.storage_offset(), tuple(host.shape)


class _Fetch(Function):
    """A host piece's copy on the device; backward copies the gradient to the host."""

    @staticmethod
    def forward(ctx, host, fetcher):
        ctx.host = host.device
        return fetcher.take(host)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.host, copy=True), None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def autopar_fetch(fetcher: Fetcher, hosts, *, ahead=(), behind=()):
    """The device copies of the host pieces ``hosts`` (a tuple), fetched by ``fetcher`` for one
    run of a layer (module docstring); the next run's pieces ``ahead`` are prefetched (in
    backward, where a recomputed layer runs this again, the previous run's ``behind``)."""
    out = []
    for host in hosts:
        copy = _Fetch.apply(host, fetcher)
        note(copy, lambda host=host: fetcher.again(host, behind))
        out.append(copy)
    fetcher.prefetch(behind if _in_backward() else ahead)
    return tuple(out)


def fetch_groups(program: torch.fx.GraphModule, offloaded: set[str]) -> list[tuple[tuple, dict]]:
    """``((run index, layer), {placeholder: [its users there, in graph order]})`` per run of
    ``program`` (:func:`~autopar.runtime.recompute.layer_runs`) reading placeholders named in
    ``offloaded``, in graph order. A user outside the layers whose own users are all in one
    layer's run (a gradient sum code generation put in front of a layer) counts as that run's."""
    from autopar.runtime.recompute import layer_runs

    runs = layer_runs(program)
    order = {n: k for k, n in enumerate(program_nodes(program.graph))}

    def run_of(user):
        if runs[user.name][1] is None:
            after = {runs[u.name] for u in user.users if u in order}
            if len(after) == 1 and next(iter(after))[1] is not None:
                return next(iter(after))
        return runs[user.name]

    groups: dict[tuple, dict] = {}
    for p in program.graph.find_nodes(op="placeholder"):
        if p.name not in offloaded:
            continue
        for user in sorted((u for u in p.users if u in order and tiled_weight(u) is not p), key=order.__getitem__):
            groups.setdefault(run_of(user), {}).setdefault(p, []).append(user)
    return sorted(groups.items(), key=lambda kv: min(order[users[0]] for users in kv[1].values()))


def fetch_parameters(program: torch.fx.GraphModule, offloaded: set[str], fetcher: Fetcher,
                     tiles: dict | None = None) -> torch.fx.GraphModule:
    """``program`` with the placeholders named in ``offloaded`` (host pieces) fetched per run by
    ``fetcher`` (module docstring; the program's attribute ``autopar_fetcher``); the fetch and
    its items carry the run's layer, so a recomputed layer fetches again in its recomputation.
    The nodes named in ``tiles`` run tile by tile from their weight on the host
    (:mod:`autopar.runtime.tiles`)."""
    program = torch.fx.GraphModule(program, copy.deepcopy(program.graph))  # the emitted one stays as it is
    program.autopar_fetcher = fetcher
    _placeholders_first(program.graph)  # a fetch may read every piece ahead of the run it serves
    if tiles:
        tile_nodes(program.graph, tiles, offloaded, lambda node: _fetcher_node(program.graph))
    groups = fetch_groups(program, offloaded)
    order = {n: k for k, n in enumerate(program_nodes(program.graph))}
    graph = program.graph
    hosts = [tuple(members) for _, members in groups]
    for k, ((_, layer), members) in enumerate(groups):
        first = min((users[0] for users in members.values()), key=order.__getitem__)
        ahead = hosts[k + 1] if k + 1 < len(hosts) else ()
        behind = hosts[k - 1] if k else ()
        with graph.inserting_before(first):
            source = _fetcher_node(graph)
            fetch = graph.call_function(autopar_fetch, (source, hosts[k]), {"ahead": ahead, "behind": behind})
            source.meta["autopar_layer"] = fetch.meta["autopar_layer"] = layer
            for i, (p, users) in enumerate(members.items()):
                item = graph.call_function(operator.getitem, (fetch, i))
                item.meta["autopar_layer"] = layer
                for user in users:
                    user.replace_input_with(p, item)
    graph.lint()
    program.recompile()
    return program


def _placeholders_first(graph: torch.fx.Graph) -> None:
    """Move the placeholders code generation left after a node (``rank_device``, read from the
    first one) in front of it, keeping their order."""
    nodes = list(graph.nodes)
    first = next((n for n in nodes if n.op != "placeholder"), None)
    for node in nodes[nodes.index(first):] if first is not None else ():
        if node.op == "placeholder":
            first.prepend(node)


def _fetcher_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """A node reading the program's fetcher (at the graph's insertion point)."""
    with warnings.catch_warnings():  # a plain attribute, not a module, parameter or buffer
        warnings.simplefilter("ignore", UserWarning)
        return graph.get_attr("autopar_fetcher")


__all__ = ["Fetcher", "autopar_fetch", "fetch_groups", "fetch_parameters"]
