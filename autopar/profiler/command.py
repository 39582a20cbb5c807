"""``autopar profile``: measure this machine, store the profile, print the calibrated cluster."""

from __future__ import annotations

from autopar.cost_models.cluster import Cluster
from autopar.profiler.database import profile


def add_profile_arguments(parser) -> None:
    """Options of ``autopar profile``."""
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks to profile (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="threads per CPU rank (default: cores / ranks)")
    parser.add_argument("--preset", default=None, help="profile a GPU preset's device on this machine's GPUs instead")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the preset (default 1)")
    parser.add_argument("--cache-dir", default=None, help="profile database directory (default ~/.cache/autopar)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")


def run_profile_command(args) -> int:
    """``autopar profile``: measure, store, print the calibrated cluster."""
    if args.preset:
        cluster = Cluster.preset(args.preset, nodes=args.nodes, use_profile=False)
    else:
        cluster = Cluster.local(world_size=args.world_size, threads_per_rank=args.threads, use_profile=False)
    calibrated = profile(cluster, cache_dir=args.cache_dir, quick=args.quick)
    spec = calibrated.device_spec
    print(calibrated.describe())
    print(f"  {spec.name}: peak {spec.peak('bf16' if spec.kind == 'gpu' else 'fp32') / 1e9:.4g} GFLOP/s,"
          f" memory {spec.memory_bandwidth / 1e9:.3g} GB/s, overhead {spec.op_overhead * 1e6:.3g} us,"
          f" matmul half-dim {spec.matmul_half_dim:.3g}")
    print("  efficiency: " + ", ".join(f"{k} {v:.2f}" for k, v in spec.efficiency))
    if spec.class_overhead:
        print("  set-up per kernel: " + ", ".join(f"{k} {v * 1e6:.3g} us" for k, v in spec.class_overhead))
    for fit in calibrated.calibration.collectives:
        print(f"  {fit.kind} over {fit.group_size} ({fit.level}): alpha {fit.alpha * 1e6:.0f} us,"
              f" {1 / fit.beta / 1e9:.3g} GB/s algbw")
    return 0


__all__ = ["add_profile_arguments", "run_profile_command"]
