"""Plan LLaMA-2-70B training on two DGX H100 nodes (2 x 8 GPUs) without any GPU or real memory.

The model is built on the meta device (no weights are allocated) and captured on fake tensors,
so this runs on a laptop. It prints the plan's summary, saves it as ``llama70b_plan.json`` and
draws ``llama70b_plan.html`` (schedule, memory per device, sharding map)::

    python examples/llama70b_2x8_h100.py [--batch 2] [--seq 4096] [--optimizer sgd] [--png]

Why SGD by default: with mixed-precision Adam every parameter costs 16 bytes of state (bf16
weight and gradient, fp32 master weight and two moments), 1.1 TB for 70B parameters, which is
69 GiB on each of 16 GPUs before a single activation; autopar then reports that no plan fits
(``--optimizer adam`` shows its message with the smallest achievable peak). Mixed-precision SGD
needs 8 bytes per parameter. The plan pipelines the 80 layers over the two nodes (stages,
micro-batches and recomputation are searched with the shardings).

Capture and planning take about ten seconds on a small machine (progress is printed);
``--png`` also draws the plan as a PNG.
"""

import argparse
import logging
import time

from autopar import Cluster, InfeasibleError, zoo
from autopar.compile import compile
from autopar.core.options import Options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="global batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    parser.add_argument("--out", default="llama70b_plan.json")
    parser.add_argument("--png", action="store_true", help="also draw the plan as a PNG (needs matplotlib)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms  %(message)s")

    start = time.perf_counter()
    model, (positional, labels) = zoo.llama(config=zoo.llama2_70b_config(), seq=args.seq,
                                            batch=args.batch, device="meta")
    params = sum(p.numel() for p in model.parameters())
    print(f"LLaMA-2-70B: {params / 1e9:.1f} B parameters on the meta device"
          f" (built in {time.perf_counter() - start:.1f} s)")

    cluster = Cluster.preset("dgx-h100", nodes=2)
    print(cluster.describe())
    options = Options(mixed_precision=True, optimizer=args.optimizer)
    try:
        compiled = compile(model, cluster, example_inputs={"input_ids": positional[0], **labels},
                           options=options)
    except InfeasibleError as exc:
        print(f"no plan fits: {exc}")
        raise SystemExit(1) from None
    plan = compiled.plan
    print(plan.summary())
    plan.save(args.out)
    stem = args.out.rsplit(".", 1)[0]
    drawn = [plan.render(f"{stem}.{ext}") for ext in ("html", "png")[:2 if args.png else 1]]
    print(f"saved {args.out} and {' and '.join(drawn)} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
