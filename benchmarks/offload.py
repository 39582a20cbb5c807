"""Models that do not fit their devices: what autopar plans (the optimizer offloaded to the host
where nothing fits without it), the runner-up, and ``verify`` of the winner on fake tensors.

Per case: the plan (mesh, ZeRO stage, offload, recompute, pipeline stages), its predicted step
time, device peak and host bytes per device; the runner-up (the same search with the optimizer
kept on the devices: its step time, or "no plan fits" with its smallest peak); verify's measured
device peak and host peak with their ratios, and the seconds planning and verifying took.
Models are built on the meta device from configs (no memory, no download); every case trains in
bf16 mixed precision (fp32 masters), AdamW.

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


CASES = [
    # (name, model, cluster, options)
    ("llama-13B-shape, 1 GPU", lambda: _llama(40, 5120, 40, 13824, 1, 2048), _one_a100, {}),
    ("llama-30B-shape, 8 GPUs no NVLink", lambda: _llama(60, 6656, 52, 17920, 8, 2048), _pcie_node, {}),
    ("llama-7B-shape, 1 GPU", lambda: _llama(32, 4096, 32, 11008, 1, 2048), _one_a100, {}),
]


def run_case(name, make_model, make_cluster, extra) -> dict:
    model, (args, kwargs) = make_model()
    inputs = {"input_ids": args[0], **kwargs}
    cluster = make_cluster()
    options = Options(mixed_precision=True, pipeline=False, **extra)
    start = time.perf_counter()
    compiled = compile(model, cluster, example_inputs=inputs, options=options)
    planned = time.perf_counter() - start
    plan = compiled.plan
    try:
        kept = dataclasses.replace(options, offload=False)
        runner = compile(model, cluster, example_inputs=inputs, options=kept).plan
        runner_up = f"{runner.predicted_step_time:.2f} s (offload={runner.offload}, zero={runner.zero})"
    except InfeasibleError as exc:
        runner_up = f"no plan fits without offload (smallest peak {exc.smallest_peak / GiB:.1f} GiB)"
    start = time.perf_counter()
    (rank, *_) = compiled.verify().ranks
    return {"case": name, "cluster": cluster.name, "mesh": plan.mesh_shape, "zero": plan.zero, "offload": plan.offload,
            "recompute": plan.recompute, "step": plan.predicted_step_time, "offload_s": plan.time.offload,
            "peak": plan.predicted_peak_memory, "host": plan.host_memory, "measured": rank.measured.peak,
            "host_measured": rank.measured.host_peak, "runner_up": runner_up, "plan_s": planned,
            "verify_s": time.perf_counter() - start, "ok": not rank.problems(),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    print("| case | cluster | plan | step s (offload s) | device peak GiB pred/meas | host GiB/device pred/meas"
          " | runner-up | plan s | verify s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        if args.only and not any(s in case[0] for s in args.only):
            continue
        r = run_case(*case)
        what = f"mesh {r['mesh']}, zero={r['zero']}, offload={r['offload']}, recompute={r['recompute']}"
        print(f"| {r['case']} | {r['cluster']} | {what} | {r['step']:.2f} ({r['offload_s']:.2f}) |"
              f" {r['peak'] / GiB:.1f}/{r['measured'] / GiB:.1f} ({r['peak'] / r['measured']:.3f}) |"
              f" {r['host'] / GiB:.1f}/{r['host_measured'] / GiB:.1f} | {r['runner_up']} | {r['plan_s']:.0f} |"
              f" {r['verify_s']:.0f}{'' if r['ok'] else ' MISMATCH'} |", flush=True)


if __name__ == "__main__":
    main()
