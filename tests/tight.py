"""Plans made under the least memory they can run in: what a memory-bound user gets (sharded
weights and optimizer state where the plan kind allows them)."""

import dataclasses

from autopar import Options
from autopar.core.errors import InfeasibleError


def tightest(make, cluster):
    """``make(cluster, options)``'s plan on ``cluster`` with only the memory per device that the
    smallest peak a "no plan fits" error reports (plus 0.1 %)."""
    options = Options(memory_fraction=1.0)
    try:
        make(dataclasses.replace(cluster, device_memory=1.0), options)
    except InfeasibleError as exc:
        return make(dataclasses.replace(cluster, device_memory=exc.smallest_peak * 1.001), options)
    raise AssertionError("a plan fitted in 1 byte per device")
