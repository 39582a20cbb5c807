"""The cluster a plan targets: a logical device mesh, the device type, links, memory per device.

Ranks are numbered row-major over ``mesh_shape`` and packed ``devices_per_node`` to a node, so in
a ``(2, 8)`` mesh of two 8-GPU nodes axis 1 runs inside a node and axis 0 across nodes. An axis
whose group spans several nodes with several members in each (``(4, 4)`` on the same 16 GPUs)
communicates hierarchically::

    >>> c = Cluster.preset("dgx-a100", nodes=2)
    >>> c.mesh_shape, c.num_devices
    ((2, 8), 16)
    >>> c.collective_time("all_reduce", 1e9, 1)   # 1 GB over NVSwitch, 8 GPUs  # doctest: +SKIP

Bandwidths are bytes/s per device in one direction: a node's network bandwidth is divided among
its devices (all ranks communicate at once in SPMD).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from autopar.core.errors import ClusterError
from autopar.cost_models.calibration import (
    Calibration,
    gpu_device_key,
    load_calibration,
    local_device_key,
)
from autopar.cost_models.communication import Link, flat_time, hierarchical_time
from autopar.cost_models.devices import CPU_CORE_MEMORY_BANDWIDTH, DeviceSpec, cpu_spec, device_spec
from autopar.cost_models.host import ADAM_HOST_BYTES, HOSTS, SGD_HOST_BYTES, Host

# Per-direction NVLink bandwidth per GPU (datasheets: V100 NVLink2 300 GB/s, A100 NVLink3 600 GB/s,
# H100/H200 NVLink4 900 GB/s, all bidirectional totals).
NVLINK_BANDWIDTH = {"V100-16GB": 150e9, "A100-80GB": 300e9, "A100-40GB": 300e9,
                    "H100-80GB": 450e9, "H200-141GB": 450e9, "GH200-96GB": 450e9}
# Per-step latencies of a ring collective, order of magnitude (NCCL small-message all-reduce on
# 8 NVLink GPUs takes ~10-20 us over 14 steps; InfiniBand adds a few us per hop; kernel TCP over
# Ethernet tens of us). The profiler measures them.
NVLINK_STEP_LATENCY = 1.5e-6
INFINIBAND_STEP_LATENCY = 6e-6
ETHERNET_STEP_LATENCY = 30e-6
# gloo over 127.0.0.1 between local processes (FIELD-NOTES: ~0.3 ms per 2-rank all-reduce, ~1 GB/s).
LOOPBACK_BANDWIDTH = 1e9
LOOPBACK_STEP_LATENCY = 150e-6

GBIT = 1e9 / 8  # bytes/s in one Gbit/s

PRESETS = {
    # Alpa's testbed (Zheng et al. 2022, Sec. 8): AWS p3.16xlarge, 8x V100-16GB with NVLink,
    # 25 Gbit/s Ethernet per node shared by its 8 GPUs.
    "dgx-v100": dict(device="V100-16GB", devices_per_node=8, intra_node_bandwidth=150e9,
                     intra_node_latency=NVLINK_STEP_LATENCY, inter_node_bandwidth=25 * GBIT / 8,
                     inter_node_latency=ETHERNET_STEP_LATENCY),
    # DGX A100: NVSwitch (NVLink3), 8x Mellanox HDR 200 Gbit/s InfiniBand: one per GPU.
    "dgx-a100": dict(device="A100-80GB", devices_per_node=8, intra_node_bandwidth=300e9,
                     intra_node_latency=NVLINK_STEP_LATENCY, inter_node_bandwidth=200 * GBIT,
                     inter_node_latency=INFINIBAND_STEP_LATENCY),
    # DGX H100: NVLink4 via NVSwitch, 8x ConnectX-7 NDR 400 Gbit/s: one per GPU.
    "dgx-h100": dict(device="H100-80GB", devices_per_node=8, intra_node_bandwidth=450e9,
                     intra_node_latency=NVLINK_STEP_LATENCY, inter_node_bandwidth=400 * GBIT,
                     inter_node_latency=INFINIBAND_STEP_LATENCY),
    # HGX H200: H100's NVLink4 and NDR networking with H200 GPUs.
    "dgx-h200": dict(device="H200-141GB", devices_per_node=8, intra_node_bandwidth=450e9,
                     intra_node_latency=NVLINK_STEP_LATENCY, inter_node_bandwidth=400 * GBIT,
                     inter_node_latency=INFINIBAND_STEP_LATENCY),
    # GH200 nodes: one Grace Hopper superchip each, one ConnectX-7 NDR 400 Gbit/s per superchip.
    "gh200": dict(device="GH200-96GB", devices_per_node=1, intra_node_bandwidth=450e9,
                  intra_node_latency=NVLINK_STEP_LATENCY, inter_node_bandwidth=400 * GBIT,
                  inter_node_latency=INFINIBAND_STEP_LATENCY),
}


@dataclass(frozen=True)
class Cluster:
    """A logical mesh of identical devices. See the module docstring for the rank layout.

    ``device``: a name from :data:`autopar.cost_models.devices.DEVICES` or a ``DeviceSpec``.
    ``device_memory``: bytes per device (None: the device's own). ``axis_links``: one
    :class:`Link` per mesh axis to override the topology (flat, no hierarchy). ``calibration``:
    measured constants (:meth:`profile`, or loaded by :meth:`local`). ``host``: each node's
    CPU memory, host-device link and CPU memory bandwidth (:mod:`autopar.cost_models.host`;
    None: unknown, and nothing is offloaded to it).
    """

    mesh_shape: tuple[int, ...] = (1,)
    device: str | DeviceSpec = "A100-80GB"
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    device_memory: float | None = None
    devices_per_node: int | None = None
    intra_node_latency: float = NVLINK_STEP_LATENCY
    inter_node_latency: float = INFINIBAND_STEP_LATENCY
    axis_links: tuple[Link, ...] | None = None
    calibration: Calibration | None = None
    name: str = ""
    host: Host | None = None

    def __post_init__(self):
        shape = self.mesh_shape
        if isinstance(shape, int) or not isinstance(shape, (tuple, list)):
            raise ClusterError(f"mesh_shape must be a tuple of 1-3 ints, e.g. (2, 8); got {shape!r}")
        if not 1 <= len(shape) <= 3 or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ClusterError(f"mesh_shape must be 1-3 positive ints, e.g. (2, 8); got {shape!r}")
        object.__setattr__(self, "mesh_shape", tuple(shape))
        spec = self.device_spec  # validates the device name
        if self.devices_per_node is None:
            object.__setattr__(self, "devices_per_node", self.mesh_shape[-1])
        g = self.devices_per_node
        if not isinstance(g, int) or g < 1 or (g < self.num_devices and self.num_devices % g):
            raise ClusterError(
                f"devices_per_node={g!r} must be a positive int dividing the {self.num_devices}"
                f" devices of mesh {self.mesh_shape}"
            )
        if self.intra_node_bandwidth is None:
            default = NVLINK_BANDWIDTH.get(spec.name, LOOPBACK_BANDWIDTH if spec.kind == "cpu" else None)
            if default is None:
                raise ClusterError(f"no default intra-node bandwidth for {spec.name}; pass"
                                   " intra_node_bandwidth= (bytes/s per device, one direction)")
            object.__setattr__(self, "intra_node_bandwidth", float(default))
        for key in ("intra_node_bandwidth", "inter_node_bandwidth", "device_memory"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ClusterError(f"{key} must be a positive number (bytes or bytes/s), got {value!r}")
        for key in ("intra_node_latency", "inter_node_latency"):
            if not (isinstance(getattr(self, key), (int, float)) and getattr(self, key) >= 0):
                raise ClusterError(f"{key} must be >= 0 seconds")
        if self.num_nodes > 1 and self.inter_node_bandwidth is None and self.axis_links is None:
            raise ClusterError(
                f"the mesh spans {self.num_nodes} nodes of {g} devices: pass inter_node_bandwidth="
                " (bytes/s per device) or use Cluster.preset(...)"
            )
        for axis in range(len(self.mesh_shape)):
            self.axis_span(axis)  # raises on a mesh that straddles nodes unevenly
        if self.axis_links is not None:
            links = tuple(self.axis_links)
            if len(links) != len(self.mesh_shape) or not all(isinstance(x, Link) for x in links):
                raise ClusterError(f"axis_links needs one Link per mesh axis ({len(self.mesh_shape)})")
            object.__setattr__(self, "axis_links", links)
        if self.host is not None and not isinstance(self.host, Host):
            raise ClusterError(f"host must be an autopar.cost_models.host.Host or None, got {self.host!r}")

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, *, nodes: int = 1, mesh_shape: tuple[int, ...] | None = None,
               cache_dir=None, use_profile: bool = True) -> "Cluster":
        """A known cluster: ``"dgx-v100"``, ``"dgx-a100"``, ``"dgx-h100"``, ``"dgx-h200"``,
        ``"gh200"`` (one GH200 superchip per node).

        The mesh is ``(nodes, 8)`` (``(nodes,)`` for one device per node); ``mesh_shape`` views
        the same devices as another mesh. A profile of this device type and device count stored
        by ``autopar profile --preset`` is used when present (``use_profile``); the datasheet
        constants otherwise.
        """
        if name not in PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; use one of {sorted(PRESETS)}")
        if not isinstance(nodes, int) or nodes < 1:
            raise ClusterError(f"nodes must be a positive int, got {nodes!r}")
        params = PRESETS[name]
        per_node = params["devices_per_node"]
        cluster = cls(mesh_shape=(nodes, per_node) if per_node > 1 else (nodes,), name=name, host=HOSTS[name],
                      **params)
        if use_profile:
            key = gpu_device_key(cluster.device_spec.name)
            cluster = cluster.with_calibration(load_calibration(key, cluster.num_devices, cache_dir=cache_dir))
        return cluster.with_mesh(mesh_shape) if mesh_shape is not None else cluster

    @classmethod
    def local(cls, world_size: int = 1, *, threads_per_rank: int | None = None, cache_dir=None,
              use_profile: bool = True) -> "Cluster":
        """``world_size`` CPU ranks on this machine (gloo over 127.0.0.1), one node.

        Each rank gets ``threads_per_rank`` cores (default: cores // world_size) and an equal
        share of RAM. A profile stored by :meth:`profile` / ``autopar profile`` for this CPU and
        world size is loaded when present (``use_profile``); analytic constants otherwise.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ClusterError(f"world_size must be a positive int, got {world_size!r}")
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        spec = cpu_spec(threads=threads, memory_bytes=ram // world_size)
        calibration = None
        if use_profile:
            calibration = load_calibration(local_device_key(threads), world_size, cache_dir=cache_dir)
        # the ranks' "host" is the same RAM: offloading moves tensors between copies in it
        host = Host(memory=ram, link_bandwidth=CPU_CORE_MEMORY_BANDWIDTH * threads,
                    memory_bandwidth=CPU_CORE_MEMORY_BANDWIDTH * threads * world_size,
                    source="this machine's RAM (analytic placeholder bandwidths)")
        return cls(mesh_shape=(world_size,), device=spec, devices_per_node=world_size,
                   intra_node_bandwidth=LOOPBACK_BANDWIDTH, intra_node_latency=LOOPBACK_STEP_LATENCY,
                   calibration=calibration, name=f"local-{world_size}", host=host)

    def with_mesh(self, mesh_shape: tuple[int, ...]) -> "Cluster":
        """The same devices viewed as another logical mesh (same device count)."""
        shape = tuple(mesh_shape)
        if math.prod(shape) != self.num_devices:
            raise ClusterError(f"mesh {shape} has {math.prod(shape)} devices; this cluster has"
                               f" {self.num_devices}: pick a shape whose product is {self.num_devices}")
        if self.axis_links is not None and shape != self.mesh_shape:
            raise ClusterError("axis_links are tied to the mesh axes; give intra/inter-node"
                               " bandwidths instead to re-shape the mesh")
        return dataclasses.replace(self, mesh_shape=shape)

    def with_calibration(self, calibration: Calibration | None) -> "Cluster":
        return dataclasses.replace(self, calibration=calibration)

    # --- properties -----------------------------------------------------------------------------

    @property
    def device_spec(self) -> DeviceSpec:
        """The device's spec, calibrated when a calibration is attached."""
        if self.calibration is not None and self.calibration.device is not None:
            return self.calibration.device
        if isinstance(self.device, DeviceSpec):
            return self.device
        if not isinstance(self.device, str):
            raise ClusterError(f"device must be a name like 'A100-80GB' or a DeviceSpec, got {self.device!r}")
        return device_spec(self.device)

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_devices // self.devices_per_node)

    @property
    def memory_per_device(self) -> float:
        return float(self.device_memory or self.device_spec.memory_bytes)

    @property
    def host_memory_per_device(self) -> float:
        """Bytes of host memory each device's share of its node holds (0: no host known)."""
        return self.host.memory / self.devices_per_node if self.host is not None else 0.0

    @property
    def host_link_bandwidth(self) -> float:
        """Bytes/s one device copies to or from the host (measured when calibrated)."""
        measured = self.calibration.host_link_bandwidth if self.calibration is not None else None
        if measured:
            return measured
        if self.host is None:
            raise ClusterError("this cluster has no host described: pass host=autopar.cost_models.host.Host(...)")
        return self.host.link_bandwidth

    def host_step_rate(self, optimizer: str = "adam") -> float:
        """Parameters/s the host's CPUs step with ``optimizer`` for one device (measured when
        calibrated: an Adam rate, scaled to SGD by the bytes each moves)."""
        measured = self.calibration.host_step_rate if self.calibration is not None else None
        if measured:
            return measured * (1.0 if optimizer == "adam" else ADAM_HOST_BYTES / SGD_HOST_BYTES)
        if self.host is None:
            raise ClusterError("this cluster has no host described: pass host=autopar.cost_models.host.Host(...)")
        return self.host.step_rate(self.devices_per_node, optimizer)

    @property
    def links(self) -> tuple[Link, ...]:
        """Per mesh axis, the link its slowest hop uses (inter-node when the axis spans nodes)."""
        if self.axis_links is not None:
            return self.axis_links
        return tuple(self.link("inter" if self.axis_span(a)[1] > 1 else "intra")
                     for a in range(len(self.mesh_shape)))

    def link(self, level: str) -> Link:
        """The ``"intra"``- or ``"inter"``-node link (measured when calibrated)."""
        if self.calibration is not None:
            measured = self.calibration.link(level)
            if measured is not None:
                return measured
        if level == "intra":
            return Link(self.intra_node_bandwidth, self.intra_node_latency)
        if level == "inter":
            if self.inter_node_bandwidth is None:
                raise ClusterError("this cluster is one node; it has no inter-node link")
            return Link(self.inter_node_bandwidth, self.inter_node_latency)
        raise ClusterError(f"level must be 'intra' or 'inter', got {level!r}")

    def axis_span(self, axis: int) -> tuple[int, int]:
        """``(members per node, nodes)`` of one group along mesh ``axis``."""
        if not isinstance(axis, int) or not 0 <= axis < len(self.mesh_shape):
            raise ClusterError(f"mesh axis {axis!r} out of range for mesh {self.mesh_shape}")
        n, g = self.mesh_shape[axis], self.devices_per_node
        stride = math.prod(self.mesh_shape[axis + 1:])
        if self.num_devices <= g or (stride * n <= g and g % (stride * n) == 0):
            return n, 1
        if stride >= g and stride % g == 0:
            return 1, n
        if g % stride == 0 and (stride * n) % g == 0:
            return g // stride, n * stride // g
        raise ClusterError(
            f"mesh axis {axis} (size {n}, stride {stride}) straddles nodes of {g} devices unevenly;"
            f" choose a mesh whose trailing axes multiply to a divisor or multiple of {g}"
        )

    def stage_link(self) -> Link:
        """The link between pipeline stages: inter-node on a cluster of several nodes."""
        return self.link("inter") if self.num_nodes > 1 else self.link("intra")

    # --- costs ----------------------------------------------------------------------------------

    def _flat(self, kind: str, nbytes: float, n: int, level: str) -> float:
        if self.calibration is not None and n > 1:
            fit = self.calibration.collective_fit(kind, n, level)
            if fit is not None:
                return fit.time(nbytes)
        return flat_time(kind, nbytes, n, self.link(level))

    def collective_time(self, kind: str, nbytes: float, axis: int | tuple[int, ...]) -> float:
        """Seconds for collective ``kind`` over ``nbytes`` (nccl-tests' size: the larger buffer)
        on mesh ``axis`` or on the group spanned by a tuple of axes."""
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        if not axes or len(set(axes)) != len(axes):
            raise ClusterError(f"axis must be a mesh axis or a tuple of distinct axes, got {axis!r}")
        spans = [self.axis_span(a) for a in axes]
        if self.axis_links is not None:
            n = math.prod(self.mesh_shape[a] for a in axes)
            slow = min((self.axis_links[a] for a in axes), key=lambda x: x.bandwidth)
            return flat_time(kind, nbytes, n, slow)
        local = math.prod(s[0] for s in spans)
        nodes = math.prod(s[1] for s in spans)
        return hierarchical_time(kind, nbytes, local=local, nodes=nodes, flat=self._flat)

    # --- text and data --------------------------------------------------------------------------

    def describe(self) -> str:
        spec = self.device_spec
        lines = [f"{self.name or 'cluster'}: mesh {self.mesh_shape}, {self.num_devices} x {spec.name}"
                 f" ({self.memory_per_device / 2**30:.1f} GiB each), {self.num_nodes} node(s) of"
                 f" {self.devices_per_node}"]
        for a, link in enumerate(self.links):
            local, nodes = self.axis_span(a)
            where = "inside a node" if nodes == 1 else (f"across {nodes} nodes" if local == 1 else
                                                         f"{local} per node x {nodes} nodes")
            lines.append(f"  axis {a}: size {self.mesh_shape[a]}, {where}, {link.bandwidth / 1e9:.3g} GB/s,"
                         f" {link.latency * 1e6:.3g} us/step")
        if self.host is not None:
            lines.append(f"  host: {self.host.memory / 2**30:.0f} GiB per node,"
                         f" {self.host_link_bandwidth / 1e9:.3g} GB/s"
                         f" per device to/from it, {self.host_step_rate() / 1e6:.0f} M Adam parameters/s per device")
        lines.append("  constants: " + (f"measured ({self.calibration.key})" if self.calibration else "analytic"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["mesh_shape"] = list(self.mesh_shape)
        if isinstance(self.device, DeviceSpec):
            out["device"] = self.device.to_dict()
        out["axis_links"] = ([dataclasses.asdict(x) for x in self.axis_links]
                             if self.axis_links is not None else None)
        out["calibration"] = self.calibration.to_dict() if self.calibration else None
        out["host"] = dataclasses.asdict(self.host) if self.host is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Cluster":
        data = dict(data)
        data["mesh_shape"] = tuple(data["mesh_shape"])
        if isinstance(data.get("device"), dict):
            data["device"] = DeviceSpec.from_dict(data["device"])
        if data.get("axis_links") is not None:
            data["axis_links"] = tuple(Link(**x) for x in data["axis_links"])
        if data.get("calibration") is not None:
            data["calibration"] = Calibration.from_dict(data["calibration"])
        if data.get("host") is not None:
            data["host"] = Host(**data["host"])
        return cls(**data)


__all__ = ["Cluster", "PRESETS"]
