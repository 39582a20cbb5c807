"""The whole profile of a cluster's devices on this machine: compute (on every CPU rank at once),
collectives per mesh axis, fits, and an entry in the profile database
(:mod:`autopar.cost_models.calibration`), which ``Cluster.local`` reads::

    cluster = profile(autopar.Cluster.local(world_size=2))   # or: autopar profile --world-size 2
"""

from __future__ import annotations

import datetime

import torch

from autopar.core.collective_kinds import COLLECTIVE_KINDS
from autopar.core.errors import ClusterError
from autopar.cost_models.calibration import Calibration, entry_key, gpu_device_key, local_device_key, write_entry
from autopar.cost_models.cluster import Cluster
from autopar.cost_models.devices import DeviceSpec, device_spec
from autopar.profiler.calibrate import calibrate_device, fit_collectives
from autopar.profiler.collectives import COLLECTIVE_SIZES, QUICK_COLLECTIVE_SIZES, measure_collectives
from autopar.profiler.compute import measure_compute_concurrently
from autopar.profiler.host import measure_host


def profile(cluster, *, cache_dir=None, quick: bool = False, progress=print) -> Cluster:
    """Measure this machine for ``cluster`` (matmul, memory, collectives per mesh axis, the host's
    link and optimizer step), store the results in the profile database and return ``cluster`` calibrated with them."""
    return cluster.with_calibration(profile_cluster(cluster, cache_dir=cache_dir, quick=quick, progress=progress))


def profile_cluster(cluster, *, cache_dir=None, quick: bool = False, progress=print,
                    kinds=COLLECTIVE_KINDS) -> Calibration:
    """Profile the devices ``cluster`` describes on this machine; store and return the result."""
    spec = cluster.device if isinstance(cluster.device, DeviceSpec) else device_spec(cluster.device)
    if spec.kind == "cpu":
        device, backend, key = "cpu", "gloo", local_device_key(spec.threads)
        dtype = torch.float32
    else:
        if not torch.cuda.is_available():
            raise ClusterError(f"cannot profile {spec.name} here: no CUDA device. Profile on the"
                               " GPU machine, or use Cluster.local(...) for this CPU")
        device, backend, key, dtype = "cuda", "nccl", gpu_device_key(spec.name), torch.bfloat16
    world = cluster.num_devices
    where = torch.cuda.get_device_name(0) if device == "cuda" else key
    progress(f"autopar profile: {spec.name} x {world} on mesh {cluster.mesh_shape} ({where}, {backend})")
    progress("compute (one rank):" if device != "cpu" or world == 1 else
             f"compute ({world} ranks at once, the slowest rank per case):")
    # CPU ranks share the machine: measure them all at once, as a training step runs them
    measured = measure_compute_concurrently(
        ranks=world if device == "cpu" else 1, device=device, threads=spec.threads, dtype=dtype,
        quick=quick, repeats=5 if quick else 9, progress=progress)
    calibrated = calibrate_device(spec, measured)
    results = []
    if world > 1 and (backend == "gloo" or torch.cuda.device_count() >= world):
        progress(f"collectives ({backend}, {world} ranks):")
        results = measure_collectives(
            mesh_shape=cluster.mesh_shape, kinds=kinds,
            sizes=QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES, repeats=25 if quick else 40,
            backend=backend, threads=spec.threads, progress=progress)
    elif world > 1:
        progress(f"collectives skipped: {world} ranks need {world} local GPUs")

    def level(axis):
        local, nodes = cluster.axis_span(axis)
        return "intra" if nodes == 1 else ("inter" if local == 1 else None)

    link, rate = measure_host(device, devices_per_node=min(world, cluster.devices_per_node), quick=quick,
                              progress=progress)
    calibration = Calibration(key=entry_key(key, world), device=calibrated,
                              collectives=tuple(fit_collectives(results, level)),
                              host_link_bandwidth=link, host_step_rate=rate)
    entry = {"calibration": calibration.to_dict(), "compute": measured, "collectives": results,
             "mesh_shape": list(cluster.mesh_shape), "created": datetime.datetime.now().isoformat(),
             "torch": torch.__version__}
    path = write_entry(calibration.key, entry, cache_dir)
    progress(f"saved {calibration.key} to {path}")
    return calibration


__all__ = ["profile", "profile_cluster"]
