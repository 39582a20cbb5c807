"""The profiler: measure the devices at hand and calibrate the cost models with the results.

- :mod:`~autopar.profiler.compute` times matmuls, convolutions, attention and streaming ops
  (on a GPU on one rank; CPU ranks on every rank at once, samples started together, as a step
  runs them);
- :mod:`~autopar.profiler.collectives` times every collective on every mesh axis over a sweep
  of sizes on local ranks (:mod:`autopar.runtime.launch`; gloo on CPU, NCCL on GPUs);
- :mod:`~autopar.profiler.timing` makes each measurement robust to a shared machine (the lower
  quartile of interleaved repeats);
- :mod:`~autopar.profiler.calibrate` fits a calibrated
  :class:`~autopar.cost_models.devices.DeviceSpec` and alpha/beta per collective;
- :mod:`~autopar.profiler.database` runs the whole profile and stores it in the profile
  database, which ``Cluster.local`` reads; :mod:`~autopar.profiler.command` is ``autopar profile``::

    cluster = profile(autopar.Cluster.local(world_size=2))   # or: autopar profile --world-size 2
"""

from autopar.profiler.calibrate import calibrate_device, fit_collectives
from autopar.profiler.collectives import measure_collectives
from autopar.profiler.command import add_profile_arguments, run_profile_command
from autopar.profiler.compute import measure_compute, measure_compute_concurrently, merge_compute
from autopar.profiler.database import profile, profile_cluster
from autopar.profiler.timing import robust_time, time_call, time_calls

__all__ = [
    "add_profile_arguments",
    "calibrate_device",
    "fit_collectives",
    "measure_collectives",
    "measure_compute",
    "measure_compute_concurrently",
    "merge_compute",
    "profile",
    "profile_cluster",
    "robust_time",
    "run_profile_command",
    "time_call",
    "time_calls",
]
