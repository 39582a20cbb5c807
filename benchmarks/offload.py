"""Which strategy autopar picks, from one GPU to several nodes, models that fit and models that do
not: its plan, the other side of the offload decision (the best plan with the optimizer kept on
the devices, or offloaded: its step time, or "no plan fits") and the runner-ups the search
weighed beside the winner (from ``plan.why``), and ``verify`` of the winner on fake tensors
(device peak of the worst verified rank, host bytes per device).

Models are LLaMA shapes built on the meta device from configs (no memory, no download), trained
in bf16 mixed precision (fp32 masters) with AdamW; one-program plans (pipelining is not searched
here, to keep the table minutes long). The model whose largest layer does not fit one device has
a 4M-token vocabulary (embedding and head 16.8 B parameters each) and trains on 512 tokens, so
that its logits fit: at 2048 tokens its logits and their gradients alone hold 110 GiB.

    python benchmarks/offload.py [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time

from autopar import Cluster, Options, zoo
from autopar.compile import compile
from autopar.core.errors import InfeasibleError
from autopar.cost_models.host import Host

GiB = 2**30


def _llama(layers, hidden, heads, ffn, batch, seq):
    return zoo.llama(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=32000, seq=seq,
                     batch=batch, device="meta")


def _one_a100() -> Cluster:
    """A workstation: one A100-80GB on its own PCIe Gen4 x16 link (80 % of 31.5 GB/s), one EPYC
    socket (8 channels DDR4-3200: 204.8 GB/s) with 512 GB."""
    host = Host(memory=512e9, link_bandwidth=0.8 * 31.5e9, memory_bandwidth=204.8e9,
                source="a one-GPU workstation (assumed configuration)")
    return Cluster(mesh_shape=(1,), device="A100-80GB", devices_per_node=1, name="1x A100, 512 GB host", host=host)


def _pcie_node() -> Cluster:
    """Eight A100-80GB without NVLink: the GPUs talk over PCIe Gen4 through the host."""
    a100 = Cluster.preset("dgx-a100", use_profile=False)
    return dataclasses.replace(a100, mesh_shape=(8,), intra_node_bandwidth=a100.host.link_bandwidth,
                               intra_node_latency=10e-6, name="1x8 A100 PCIe (no NVLink)")


def _slow_nodes(nodes: int) -> Cluster:
    """DGX A100 nodes joined by 25 Gbit/s Ethernet per node (instead of 8 x 200 Gbit/s InfiniBand)."""
    a100 = Cluster.preset("dgx-a100", nodes=nodes, use_profile=False)
    return dataclasses.replace(a100, inter_node_bandwidth=25e9 / 8 / 8, inter_node_latency=30e-6,
                               name=f"{nodes}x8 A100, 25 Gbit/s Ethernet")


def _a100(nodes: int) -> Cluster:
    return Cluster.preset("dgx-a100", nodes=nodes, use_profile=False)


def _big_embedding():
    """A model whose one layer does not fit a device: a 4M x 4096 embedding and head (16.8 B
    parameters each: in bf16 a weight and its gradient hold 62.5 GiB)."""
    return zoo.llama(layers=2, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=4_096_000, seq=512, batch=1,
                     device="meta")


def _one_a100_40() -> Cluster:
    """One A100-40GB on its own PCIe Gen4 x16 link, one EPYC socket with 1 TB (the 4M-token model's
    fp32 masters and Adam state need 0.75 TB)."""
    return dataclasses.replace(_one_a100(), device="A100-40GB", name="1x A100-40GB, 1 TB host",
                               host=dataclasses.replace(_one_a100().host, memory=1e12))


CASES = [
    # (situation, model name, model, cluster)
    ("one GPU, fits", "llama-1.4B-shape", lambda: _llama(24, 2048, 16, 5504, 1, 2048), _one_a100),
    ("one GPU, does not fit", "llama-7B-shape", lambda: _llama(32, 4096, 32, 11008, 1, 2048), _one_a100),
    ("one GPU, does not fit", "llama-13B-shape", lambda: _llama(40, 5120, 40, 13824, 1, 2048), _one_a100),
    ("one GPU, largest layer does not fit", "4M-token embedding", _big_embedding, _one_a100_40),
    ("one node, fits", "llama-7B-shape", lambda: _llama(32, 4096, 32, 11008, 8, 2048), lambda: _a100(1)),
    ("one node, largest layer does not fit one device", "4M-token embedding", _big_embedding, lambda: _a100(1)),
    ("one node, does not fit (NVLink)", "llama-65B-shape", lambda: _llama(80, 8192, 64, 22016, 8, 2048),
     lambda: _a100(1)),
    ("one node, does not fit (NVLink)", "llama-65B-shape, recompute=False",
     lambda: _llama(80, 8192, 64, 22016, 8, 2048), lambda: _a100(1), {"recompute": False}),
    ("one node, does not fit (PCIe, no NVLink)", "llama-30B-shape", lambda: _llama(60, 6656, 52, 17920, 8, 2048),
     _pcie_node),
    ("4 nodes, fast interconnect", "llama-30B-shape", lambda: _llama(60, 6656, 52, 17920, 32, 2048),
     lambda: _a100(4)),
    ("4 nodes, slow interconnect", "llama-30B-shape", lambda: _llama(60, 6656, 52, 17920, 32, 2048),
     lambda: _slow_nodes(4)),
]


def _other(model, cluster, inputs, options, offload: bool) -> str:
    """The best plan on the other side of the offload decision (``offload``: the optimizer on the
    host, or kept on the devices), as text."""
    try:
        plan = compile(model, cluster, example_inputs=inputs,
                       options=dataclasses.replace(options, offload=offload)).plan
    except InfeasibleError as exc:
        return f"{'offloaded' if offload else 'kept'}: no plan fits ({_peak(exc)})"
    return f"{'offloaded' if offload else 'kept'}: {plan.predicted_step_time:.2f} s"


def _runner_ups(plan) -> list[str]:
    """The other savers the search weighed beside the plan's offload and their step times (``plan.why``)."""
    why = next((w for w in plan.why if "offloaded" in w.split(": ", 1)[0]), "")
    out = [f"{what.split(' instead: ')[0]}: " + (f"{float(t[:-3]) / 1e3:.2f} s" if t.endswith(" ms") else t)
           for what in why.split("; ")[1:] if " instead: " in what for t in [what.split(" instead: ")[1]]]
    return out + [w.split(": ", 1)[1] for w in plan.why if w.startswith("tiled: ")]


def _peak(exc) -> str:
    return f"smallest peak {exc.smallest_peak / GiB:.0f} GiB" if exc.smallest_peak else "host too small"


def _what(plan) -> str:
    sharded = sum(1 for p in plan.parameter_placements.values() if any(x.startswith("S") for x in p))
    parts = [f"mesh {plan.mesh_shape}", f"{sharded}/{len(plan.parameter_placements)} weights sharded"]
    parts += [f"ZeRO-{plan.zero}"] if plan.zero else []
    parts += ["parameters offloaded" if plan.offload_parameters else "optimizer offloaded"] if plan.offload else []
    parts += [f"{', '.join(plan.tiles)} in {'/'.join(str(k) for k in plan.tiles.values())} tiles"] if plan.tiles else []
    parts += ["selective recompute" if plan.recompute == "selective" else "recompute"] if plan.recompute else []
    parts += ["checkpoints offloaded"] if plan.offload_activations else []
    return ", ".join(parts)


def run_case(situation, name, make_model, make_cluster, extra=None) -> str:
    """One row of the table (see the module docstring); ``extra``: options the case asks for."""
    model, (args, kwargs) = make_model()
    inputs = {"input_ids": args[0], **kwargs}
    cluster = make_cluster()
    options = Options(mixed_precision=True, pipeline=False, **(extra or {}))
    start = time.perf_counter()
    try:
        compiled = compile(model, cluster, example_inputs=inputs, options=options)
    except InfeasibleError as exc:
        return (f"| {situation} | {name} | {cluster.name} | no plan fits ({_peak(exc)})"
                f" | - | - | - | - | {time.perf_counter() - start:.0f} | - |")
    planned = time.perf_counter() - start
    plan = compiled.plan
    other = "; ".join([_other(model, cluster, inputs, options, not plan.offload), *_runner_ups(plan)])
    start = time.perf_counter()
    rank = max(compiled.verify().ranks, key=lambda r: r.measured.peak)
    checked = time.perf_counter() - start
    host = f"{plan.host_memory / GiB:.0f}/{rank.measured.host_peak / GiB:.0f}" if plan.offload else "-"
    return (f"| {situation} | {name} | {cluster.name} | {_what(plan)} | {plan.predicted_step_time:.2f}"
            f" ({plan.time.offload:.2f}) | {plan.predicted_peak_memory / GiB:.1f}/{rank.measured.peak / GiB:.1f}"
            f" ({rank.peak_ratio:.3f}) | {host} | {other} | {planned:.0f} | {checked:.0f}"
            f"{'' if not rank.problems() else ' MISMATCH'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="situations or models containing these")
    args = parser.parse_args()
    print("| situation | model | cluster | autopar's plan | step s (offload s) | device peak GiB pred/verify"
          " (ratio) | host GiB/device pred/verify | the other side of the offload decision; runner-ups | plan s"
          " | verify s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        if args.only and not any(s in case[0] or s in case[1] for s in args.only):
            continue
        print(run_case(*case), flush=True)
    print(f"(peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB)")


if __name__ == "__main__":
    main()
