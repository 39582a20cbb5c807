"""Plan GPT models at paper scale on fake tensors: autopar's pipeline search against the best
Megatron grid point on the same cost model.

Configurations (GPT with vocabulary 51200, tied embeddings, HF GPT-2 architecture built on the
meta device):

- the Megatron-LM paper's weak-scaling GPTs (Narayanan et al., SC'21, Table 1: 1.7B on 32 …
  1008B on 3072 A100-80GB, sequence 2048, its global batch sizes), on DGX A100 nodes;
- GPT-3 175B (96 layers, hidden 12288, batch 1536) on 128 DGX A100 nodes;
- Alpa's GPT suite (Zheng et al., OSDI'22, Table 4: 350M on 1 … 39B on 64 V100-16GB, sequence
  1024, batch 1024) on p3.16xlarge-like nodes (8 V100, 25 Gbit/s Ethernet). V100 has no bf16:
  these models are captured in fp16 and costed at the fp16 tensor-core rate.

For each row: capture (with layer stamping), build the pipeline model (window ILPs and stage
costs), search (stage DP), then the grid on the same model (:func:`autopar.planner.inter.grid_search`:
tp, pp, dp, micro-batches, ZeRO 0/1/3, recomputation, evenly split stages). It prints both
predicted step times, autopar's (tp, pp, dp, micro-batches), MFU, and the wall and CPU seconds
of autopar's compile (capture + costs + both solvers; building the model is not counted).
It checks that autopar's step time is never above the grid's.

    python benchmarks/scale.py                 # every row
    python benchmarks/scale.py --rows 175B 39B  # rows whose name contains one of these
    python benchmarks/scale.py --equal         # also search Options(stage_meshes="equal")

autopar's search is the default one (``stage_meshes="any"``: Alpa's full space, every stage its
own sub-mesh and (dp, tp), kept where it beats equal meshes). With ``--equal`` each row also runs
the search restricted to equal stage meshes on the same pipeline model and prints its step time
and configuration beside it.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Row:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    gpus: int
    preset: str


MEGATRON = [
    Row("Megatron 1.7B", 24, 2304, 24, 2048, 512, 32, "dgx-a100"),
    Row("Megatron 3.6B", 30, 3072, 32, 2048, 512, 64, "dgx-a100"),
    Row("Megatron 7.5B", 36, 4096, 32, 2048, 512, 128, "dgx-a100"),
    Row("Megatron 18.4B", 40, 6144, 48, 2048, 1024, 256, "dgx-a100"),
    Row("Megatron 39.1B", 48, 8192, 64, 2048, 1536, 512, "dgx-a100"),
    Row("Megatron 76.1B", 60, 10240, 80, 2048, 1792, 1024, "dgx-a100"),
    Row("Megatron 145.6B", 80, 12288, 96, 2048, 2304, 1536, "dgx-a100"),
    Row("Megatron 310.1B", 96, 16384, 128, 2048, 2160, 1920, "dgx-a100"),
    Row("Megatron 529.6B", 105, 20480, 128, 2048, 2520, 2520, "dgx-a100"),
    Row("Megatron 1008B", 128, 25600, 160, 2048, 3072, 3072, "dgx-a100"),
]
GPT3 = [Row("GPT-3 175B", 96, 12288, 96, 2048, 1536, 1024, "dgx-a100")]
ALPA = [
    Row("Alpa GPT 350M", 24, 1024, 16, 1024, 1024, 1, "dgx-v100"),
    Row("Alpa GPT 1.3B", 24, 2048, 32, 1024, 1024, 4, "dgx-v100"),
    Row("Alpa GPT 2.6B", 32, 2560, 32, 1024, 1024, 8, "dgx-v100"),
    Row("Alpa GPT 6.7B", 32, 4096, 32, 1024, 1024, 16, "dgx-v100"),
    Row("Alpa GPT 15B", 48, 5120, 40, 1024, 1024, 32, "dgx-v100"),
    Row("Alpa GPT 39B", 48, 8192, 64, 1024, 1024, 64, "dgx-v100"),
]
ROWS = ALPA + GPT3 + MEGATRON


def cluster_of(row: Row):
    from autopar import Cluster

    if row.gpus >= 8:
        return Cluster.preset(row.preset, nodes=row.gpus // 8, use_profile=False)
    return replace(Cluster.preset(row.preset, nodes=1, use_profile=False), mesh_shape=(row.gpus,))


def describe(choice, pipe) -> str:
    """(tp, pp, dp, B) of a choice; stages that differ are listed as tp/dp sets; the tp plans
    used (``fastest``/``megatron``/``lean`` window ILP solutions) in brackets."""
    names = {(tp, i): n for tp, table in pipe.candidate_names.items() for n, i in table.items()}
    plans = sorted({names.get((c.tp, c.candidate), "?") if c.tp > 1 else "-" for _, _, _, c in choice.stages})
    tps = sorted({c.tp for _, _, _, c in choice.stages})
    dps = sorted({c.dp for _, _, _, c in choice.stages})
    zero = sorted({c.zero for _, _, _, c in choice.stages})
    rc = sorted({c.recompute for _, _, _, c in choice.stages})

    def fmt(values):
        return "/".join(str(v) for v in values)

    extra = f" z{fmt(zero)}" + (" rc" if rc == [True] else " rc*" if True in rc else "")
    tp_plans = "" if plans == ["-"] else f" [{'/'.join(p for p in plans if p != '-')}]"
    return f"tp={fmt(tps)} pp={len(choice.stages)} dp={fmt(dps)} B={choice.batches}{extra}{tp_plans}"


def run_row(row: Row, *, equal_meshes: bool = False) -> dict:
    import torch

    from autopar import zoo
    from autopar.core.options import Options
    from autopar.passes.capture.training import capture_for_training
    from autopar.planner.inter import grid_search, search
    from autopar.planner.pipeline_model import build_model
    from autopar.planner.pipeline_plan import build_pipeline_plan

    fp16 = row.preset == "dgx-v100"
    t0 = time.perf_counter()
    model, (args, kwargs) = zoo.gpt2(layers=row.layers, hidden=row.hidden, heads=row.heads, vocab=51200,
                                     seq=row.seq, batch=row.batch, device="meta",
                                     dtype=torch.float16 if fp16 else torch.bfloat16)
    build_s = time.perf_counter() - t0
    cluster = cluster_of(row)
    options = Options(mixed_precision=not fp16, pipeline=True)
    t0, c0 = time.perf_counter(), time.process_time()
    captured = capture_for_training(model, example_inputs={"input_ids": args[0], **kwargs})
    capture_s = time.perf_counter() - t0
    pipe = build_model(captured, cluster, options)
    choice = search(pipe)
    plan = build_pipeline_plan(pipe, choice, name="autopar", solve_time=time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t1 = time.perf_counter()
    grid = grid_search(pipe)
    grid_plan = build_pipeline_plan(pipe, grid, name="grid", solve_time=0.0)
    grid_s = time.perf_counter() - t1
    if plan.predicted_step_time > grid_plan.predicted_step_time * (1 + 1e-9):
        raise AssertionError(f"{row.name}: autopar {plan.predicted_step_time} s is slower than the grid's"
                             f" {grid_plan.predicted_step_time} s on the same cost model")
    result = dict(name=row.name, gpus=row.gpus, autopar=plan.predicted_step_time,
                  grid=grid_plan.predicted_step_time, config=describe(choice, pipe), timings=dict(pipe.timings),
                  grid_config=grid.method,
                  mfu=plan.mfu, grid_mfu=grid_plan.mfu, compile_s=wall, compile_cpu_s=cpu, capture_s=capture_s,
                  grid_s=grid_s, build_s=build_s, bubble=plan.bubble_fraction,
                  params=captured.num_parameters)
    if equal_meshes:
        equal = replace(pipe, options=replace(options, stage_meshes="equal"))
        found = search(equal)
        result.update(equal=build_pipeline_plan(equal, found, name="equal", solve_time=0.0).predicted_step_time,
                      equal_config=describe(found, pipe))
    del model, captured, pipe
    gc.collect()
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=None, help="substrings of row names to run")
    parser.add_argument("--timings", action="store_true", help="print where each row's compile time went")
    parser.add_argument("--equal", action="store_true", help='also search Options(stage_meshes="equal")')
    opts = parser.parse_args(argv)
    rows = [r for r in ROWS if not opts.rows or any(s in r.name for s in opts.rows)]
    header = (f"{'model':17} {'GPUs':>5} {'params':>7} {'autopar s':>10} {'grid s':>10} {'gain':>6}"
              f" {'autopar (tp, pp, dp, B)':44} {'MFU':>5} {'grid':>5} {'compile s':>9} {'cpu s':>6}"
              f"  grid configuration")
    print(header)
    results = []
    for row in rows:
        r = run_row(row, equal_meshes=opts.equal)
        results.append(r)
        print(f"{r['name']:17} {r['gpus']:5d} {r['params'] / 1e9:6.1f}B {r['autopar']:10.3f} {r['grid']:10.3f}"
              f" {r['grid'] / r['autopar']:5.3f}x {r['config']:44} {r['mfu']:5.1%} {r['grid_mfu']:5.1%}"
              f" {r['compile_s']:9.1f} {r['compile_cpu_s']:6.1f}  {r['grid_config']}", flush=True)
        if opts.equal:
            print(f"    stage_meshes='equal': {r['equal']:.3f} s (autopar {r['equal'] / r['autopar']:.3f}x faster)"
                  f" {r['equal_config']}", flush=True)
        if opts.timings:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items())
            print(f"    capture {r['capture_s']:.1f}, {parts}; grid {r['grid_s']:.1f} s", flush=True)
    print("compile s: wall seconds of capture + window ILPs + stage costs + stage DP + plan (model"
          " construction excluded); cpu s: the same in process CPU time. z: ZeRO stage; rc: every"
          " stage recomputes, rc*: some do; [..]: the window ILP plans on tp (fastest, megatron-style,"
          " least memory).")
    return results


if __name__ == "__main__":
    main()
