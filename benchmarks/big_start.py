"""A LLaMA-style model built on ``device="meta"`` starts and trains one step under FSDP on local
gloo ranks, each rank making only its own pieces; prints every rank's peak RSS beside the
model's whole fp32 size.

    python benchmarks/big_start.py                          # ~1.5 B parameters, 4 ranks, SGD
    python benchmarks/big_start.py --optimizer adamw --layers 12
    python benchmarks/big_start.py --folder /tmp/llama-1.5b # also start from a sharded HF folder

Each rank reports its resident-set peak (``VmHWM``) after three points: the program started
(pieces materialised from the model's initialisers, or read from the folder), forward and
backward done, optimizer step done. A rank under FSDP holds a quarter of the parameters,
gradients and optimizer state on 4 ranks, plus one whole tensor while it is initialised, the
activations and torch itself (~0.3 GiB). With AdamW (two states per parameter) the model state
alone is 4 x 4 B / 4 ranks = 100 % of the whole fp32 size, so a peak under it is only possible
with SGD; the AdamW run shows what the step adds. ``--folder`` writes the reference model with
``save_pretrained`` in 1 GB shards first (one whole copy in this process, before the ranks start).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from autopar import Cluster, baselines, zoo
from autopar.compile import compile
from autopar.core.options import Options
from autopar.testing import make_optimizer, run_on_ranks

GiB = 2 ** 30


def _peak() -> float:
    """This process's resident-set peak since it started running its program (VmHWM: a spawned
    rank's ``ru_maxrss`` would also count the parent's pages it had before ``exec``)."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib * 1024 / GiB


def _rank(program, inputs, optimizer, checkpoint):
    torch.manual_seed(0)
    start = time.perf_counter()
    program.start(checkpoint)  # what compiled.runner(checkpoint=...) does on a torchrun rank
    peaks = {"started": _peak()}
    opt = make_optimizer(optimizer, program.parameters(), lr=1e-3)
    loss = program.step(inputs)
    peaks["backward"] = _peak()
    opt.step()
    peaks["optimizer step"] = _peak()
    return peaks, float(loss), time.perf_counter() - start


def _bare():
    return _peak()


def _model(args, device):
    return zoo.llama(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.heads,
                     ffn=args.ffn, vocab=args.vocab, seq=args.seq, batch=args.batch, device=device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--folder", help="also start from this sharded save_pretrained folder (written first)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")

    meta, (inputs, kwargs) = _model(args, "meta")
    n = sum(t.numel() for t in meta.parameters())
    whole = 4 * n / GiB
    print(f"LLaMA-style model: {n / 1e9:.2f} B parameters, whole fp32 size {whole:.2f} GiB;"
          f" {args.ranks} ranks, FSDP, {args.optimizer}")
    cluster = Cluster.local(world_size=args.ranks)
    example = {"input_ids": inputs[0], "labels": kwargs["labels"]}
    t = time.perf_counter()
    options = Options(optimizer="adam" if args.optimizer == "adamw" else "sgd")
    plan = baselines.fsdp(meta, cluster, example_inputs=example, options=options)
    compiled = compile(meta, cluster, plan=plan, example_inputs=example)
    print(f"planned and compiled on meta in {time.perf_counter() - t:.1f} s; the plan predicts a peak of"
          f" {plan.predicted_peak_memory / GiB:.2f} GiB per rank")
    ids = torch.randint(0, args.vocab, tuple(inputs[0].shape), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}

    bare = run_on_ranks(_bare, world_size=args.ranks)[0]
    print(f"a rank process with torch and the process group up: {bare:.2f} GiB")
    sources = {"initialisers": None}
    if args.folder:
        t = time.perf_counter()
        real, _ = _model(args, None)  # another random model than the initialisers give
        real.save_pretrained(args.folder, max_shard_size="1GB")
        del real
        print(f"wrote {args.folder} in {time.perf_counter() - t:.1f} s")
        sources["sharded folder"] = args.folder
    for source, path in sources.items():
        results = run_on_ranks(_rank, world_size=args.ranks, args=(compiled.program, batch, args.optimizer, path),
                               timeout=3600)
        print(f"\nfrom {source}: loss {results[0][1]:.4f}, {max(r[2] for r in results):.1f} s per rank")
        print(f"{'rank':>4}  " + "  ".join(f"{k:>22}" for k in results[0][0]))
        for rank, (peaks, _, _) in enumerate(results):
            print(f"{rank:>4}  " + "  ".join(f"{v:8.2f} GiB ({v / whole:5.1%})" for v in peaks.values()))


if __name__ == "__main__":
    main()
