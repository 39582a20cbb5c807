"""The host side of a node: CPU memory, the host-device link and the CPU optimizer's speed, what
offloading the optimizer (ZeRO-Offload) costs.

An offloaded step moves each stepped element's gradient to the host and its updated value back
(one direction each, over the link every device of the node uses at once) and steps it on the
CPUs, which stream the optimizer's tensors through their memory::

    >>> h = HOSTS["dgx-a100"]
    >>> round(h.step_rate(8) / 1e6)          # Adam parameters per second for one of 8 GPUs
    475

The runtime's step is the user's ``torch.optim`` optimizer on host tensors; torch's
``AdamW(foreach=True)`` on fp32 moves about :data:`ADAM_HOST_BYTES` bytes of memory traffic per
parameter (measured on this project's CPU machine: 0.23 G parameters/s where a copy streams
15.9 GB/s). ``autopar profile`` measures both constants on the machine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.core.errors import ClusterError

GB = 1e9
TB = 1e12
# memory traffic of one fp32 AdamW(foreach) step per parameter on a CPU (module docstring); SGD
# without momentum reads the parameter and gradient and writes the parameter
ADAM_HOST_BYTES = 70.0
SGD_HOST_BYTES = 12.0
# share of the DRAM's peak a streaming kernel reaches on a two-socket server (STREAM triad)
STREAM_EFFICIENCY = 0.65


@dataclass(frozen=True)
class Host:
    """One node's host: ``memory`` bytes of CPU memory, ``link_bandwidth`` bytes/s each device
    copies to or from it in one direction while all of the node's devices copy at once, and
    ``memory_bandwidth`` bytes/s of the CPUs' DRAM (peak; the step reaches
    :data:`STREAM_EFFICIENCY` of it). ``source`` says where the numbers come from."""

    memory: float
    link_bandwidth: float
    memory_bandwidth: float
    source: str = ""

    def __post_init__(self):
        for key in ("memory", "link_bandwidth", "memory_bandwidth"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ClusterError(f"Host.{key} must be a positive number (bytes or bytes/s), got {value!r}")

    def step_rate(self, devices: int, optimizer: str = "adam") -> float:
        """Parameters per second the CPUs step for one of ``devices`` devices sharing them."""
        per_parameter = ADAM_HOST_BYTES if optimizer == "adam" else SGD_HOST_BYTES
        return self.memory_bandwidth * STREAM_EFFICIENCY / per_parameter / devices


# Two GPUs share each PCIe switch's x16 uplink to the CPUs in DGX-1/DGX A100 servers, so when all
# eight copy at once each gets about half of a link (pinned-memory copies reach ~80 % of PCIe's
# per-direction peak: Gen3 x16 15.75 GB/s, Gen4 31.5, Gen5 63).
HOSTS = {
    # AWS p3.16xlarge: 488 GiB; 2x Xeon E5-2686 v4, 4 channels DDR4-2400 each (2 x 76.8 GB/s); PCIe Gen3
    "dgx-v100": Host(memory=488 * 2**30, link_bandwidth=0.8 * 15.75 * GB / 2, memory_bandwidth=153.6 * GB,
                     source="AWS p3.16xlarge, Intel Xeon E5-2686 v4 datasheets"),
    # DGX A100 640GB: 2 TB; 2x AMD EPYC 7742, 8 channels DDR4-3200 each (2 x 204.8 GB/s); PCIe Gen4
    "dgx-a100": Host(memory=2 * TB, link_bandwidth=0.8 * 31.5 * GB / 2, memory_bandwidth=409.6 * GB,
                     source="NVIDIA DGX A100 user guide, AMD EPYC 7742 datasheet"),
    # DGX H100: 2 TB; 2x Xeon Platinum 8480C, 8 channels DDR5-4800 each (2 x 307.2 GB/s); PCIe Gen5
    # (the switch sharing is assumed as in DGX A100, not checked)
    "dgx-h100": Host(memory=2 * TB, link_bandwidth=0.8 * 63 * GB / 2, memory_bandwidth=614.4 * GB,
                     source="NVIDIA DGX H100 user guide, Intel Xeon 8480C datasheet"),
    # HGX H200 servers: as DGX H100
    "dgx-h200": Host(memory=2 * TB, link_bandwidth=0.8 * 63 * GB / 2, memory_bandwidth=614.4 * GB,
                     source="as DGX H100 (HGX H200 reference servers)"),
    # GH200 Grace Hopper superchip: 480 GB LPDDR5X at up to 512 GB/s; NVLink-C2C 900 GB/s both ways
    "gh200": Host(memory=480 * GB, link_bandwidth=450 * GB, memory_bandwidth=512 * GB,
                  source="NVIDIA GH200 Grace Hopper Superchip datasheet"),
}


__all__ = ["ADAM_HOST_BYTES", "HOSTS", "Host", "SGD_HOST_BYTES", "STREAM_EFFICIENCY"]
