"""The host side of an offloaded optimizer step, measured: one device's copies to and from the
host (pinned memory on a GPU; a copy between two host tensors for CPU ranks, whose host is their
own RAM) and the CPUs' speed at torch's ``AdamW(foreach=True)`` on fp32 host tensors, the step
the runtime's offloaded optimizer runs (:mod:`autopar.cost_models.host`).

The link is measured for one device alone: when every device of a node copies at once they may
share a PCIe switch's uplink, which this does not see. The step rate is the whole host's, divided
by the devices that share it.
"""

from __future__ import annotations

import torch

from autopar.profiler.timing import time_call

LINK_BYTES, QUICK_LINK_BYTES = 256 * 2**20, 32 * 2**20
STEP_ELEMENTS, QUICK_STEP_ELEMENTS = 32 * 2**20, 4 * 2**20


def measure_host(device: str, *, devices_per_node: int, quick: bool = False, progress=print) -> tuple[float, float]:
    """``(bytes/s one device copies to or from the host, Adam parameters/s the host steps for
    each of ``devices_per_node`` devices)``."""
    nbytes = QUICK_LINK_BYTES if quick else LINK_BYTES
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    there = torch.empty(nbytes, dtype=torch.uint8, device=device)
    repeats = 3 if quick else 7
    down = time_call(lambda: host.copy_(there), repeats=repeats, device=device)
    up = time_call(lambda: there.copy_(host), repeats=repeats, device=device)
    link = nbytes / max(down, up)
    n = QUICK_STEP_ELEMENTS if quick else STEP_ELEMENTS
    weight = torch.nn.Parameter(torch.zeros(n))
    weight.grad = torch.full((n,), 1e-3)
    opt = torch.optim.AdamW([weight], lr=1e-3, foreach=True)
    rate = n / time_call(opt.step, repeats=repeats) / devices_per_node
    progress(f"  host: {link / 1e9:.3g} GB/s per device to/from it, {rate / 1e6:.0f} M Adam parameters/s per device")
    return link, rate


__all__ = ["measure_host"]
