"""Device specs: peak dense FLOP/s per dtype, memory, memory bandwidth, and roofline efficiencies.

Every hardware number is a named constant with its source. The efficiencies are the fraction of
peak an op class reaches in practice; they are defaults that the profiler replaces with
measurements (:mod:`autopar.profiler`)::

    >>> spec = device_spec("A100-80GB")
    >>> spec.peak("bf16") / 1e12
    312.0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from autopar.core.errors import ClusterError

GiB = 2**30
TFLOPS = 1e12
GBps = 1e9

# Op classes the compute model distinguishes (see autopar.cost_models.compute.op_class).
OP_CLASSES = (
    "matmul", "conv", "attention", "elementwise", "softmax", "normalization", "reduction", "indexing",
    "copy",
)
COMPUTE_CLASSES = ("matmul", "conv", "attention")

# Typical achieved fraction of peak on data-centre GPUs, before calibration. Large GEMMs reach
# 70-85 % of the datasheet peak on A100/H100 (cuBLAS); FlashAttention-2 reaches 50-70 % of peak
# in forward+backward (Dao 2023, arXiv:2307.08691, Fig. 4-6); bandwidth-bound kernels stream at
# 70-90 % of HBM peak, less for multi-pass normalisations and gathers.
DEFAULT_GPU_EFFICIENCY = (
    ("matmul", 0.75), ("conv", 0.6), ("attention", 0.55), ("elementwise", 0.8), ("softmax", 0.6),
    ("normalization", 0.6), ("reduction", 0.7), ("indexing", 0.5), ("copy", 0.8),
)
# A GEMM whose smallest dimension is d runs at d / (d + MATMUL_HALF_DIM) of the class efficiency
# (tile quantisation and wave effects); 64 puts a K=64 GEMM at half speed, a 1024-wide one at 94 %.
DEFAULT_GPU_MATMUL_HALF_DIM = 64.0
# Fixed cost per kernel: CUDA launch plus framework dispatch, a few microseconds.
DEFAULT_GPU_OP_OVERHEAD = 5e-6

_DTYPE_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8",
}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; strings pass through. Integer dtypes count as ``"fp32"``."""
    if isinstance(dtype, str):
        return dtype
    return _DTYPE_NAMES.get(dtype, "fp32")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank) as the cost model sees it.

    ``peak_flops``: ((dtype name, dense FLOP/s of the matrix units), ...); ``vector_flops``: FLOP/s
    of non-matrix (SIMD / CUDA-core fp32) arithmetic; ``memory_bandwidth`` in bytes/s;
    ``efficiency``: ((op class, fraction of peak), ...); ``matmul_half_dim``, ``op_overhead``
    (seconds per kernel) and ``class_overhead`` (((op class, extra seconds per kernel), ...), e.g.
    a CPU convolution's fixed set-up) complete the roofline in :mod:`autopar.cost_models.compute`. ``kind`` is
    ``"gpu"`` or ``"cpu"``; ``threads`` the CPU cores one rank uses (1 for a GPU).
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    vector_flops: float
    memory_bytes: int
    memory_bandwidth: float
    efficiency: tuple[tuple[str, float], ...] = DEFAULT_GPU_EFFICIENCY
    matmul_half_dim: float = DEFAULT_GPU_MATMUL_HALF_DIM
    op_overhead: float = DEFAULT_GPU_OP_OVERHEAD
    class_overhead: tuple[tuple[str, float], ...] = ()
    kind: str = "gpu"
    threads: int = 1
    source: str = ""

    def __post_init__(self):
        for table in ("peak_flops", "efficiency", "class_overhead"):  # sorted: equal after a JSON round trip
            object.__setattr__(self, table, tuple(sorted((str(k), float(v)) for k, v in getattr(self, table))))
        if not self.name:
            raise ClusterError("DeviceSpec needs a name, e.g. 'A100-80GB'")
        if not self.peak_flops or "fp32" not in dict(self.peak_flops):
            raise ClusterError(f"DeviceSpec {self.name!r}: peak_flops must include 'fp32'")
        for key, value in self.peak_flops:
            if value <= 0:
                raise ClusterError(f"DeviceSpec {self.name!r}: peak FLOP/s for {key} must be > 0")
        for key, value in self.efficiency:
            if key not in OP_CLASSES:
                raise ClusterError(f"DeviceSpec {self.name!r}: unknown op class {key!r}; use {OP_CLASSES}")
            if not 0 < value <= 1.5:
                raise ClusterError(f"DeviceSpec {self.name!r}: efficiency of {key} must be in (0, 1.5], got {value}")
        for key, value in self.class_overhead:
            if key not in OP_CLASSES or not value >= 0:
                raise ClusterError(f"DeviceSpec {self.name!r}: class_overhead needs a known op class "
                                   f"({OP_CLASSES}) and seconds >= 0, got {key!r}: {value}")
        for key in ("vector_flops", "memory_bytes", "memory_bandwidth"):
            if not getattr(self, key) > 0:
                raise ClusterError(f"DeviceSpec {self.name!r}: {key} must be positive")
        for key in ("matmul_half_dim", "op_overhead"):
            if not getattr(self, key) >= 0:
                raise ClusterError(f"DeviceSpec {self.name!r}: {key} must be >= 0")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ClusterError(f"DeviceSpec {self.name!r}: threads must be a positive int")
        if self.kind not in ("gpu", "cpu"):
            raise ClusterError(f"DeviceSpec kind must be 'gpu' or 'cpu', got {self.kind!r}")

    def peak(self, dtype) -> float:
        """Dense matrix-unit FLOP/s for ``dtype``; dtypes the device lacks fall back to fp32."""
        table = dict(self.peak_flops)
        return table.get(dtype_name(dtype), table["fp32"])

    def class_efficiency(self, op_class: str) -> float:
        """Fraction of peak (FLOP/s for compute classes, bandwidth otherwise) ``op_class`` reaches."""
        return dict(self.efficiency).get(op_class, 0.5)

    def kernel_overhead(self, op_class: str) -> float:
        """Seconds one kernel of ``op_class`` costs before any work: ``op_overhead`` plus the class's."""
        return self.op_overhead + dict(self.class_overhead).get(op_class, 0.0)

    def replace(self, **changes) -> "DeviceSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["peak_flops"] = dict(self.peak_flops)
        out["efficiency"] = dict(self.efficiency)
        out["class_overhead"] = dict(self.class_overhead)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceSpec":
        data = dict(data)
        data["peak_flops"] = tuple(data["peak_flops"].items())
        data["efficiency"] = tuple(data["efficiency"].items())
        data["class_overhead"] = tuple(data.get("class_overhead", {}).items())
        return cls(**data)


# --- NVIDIA data-centre GPUs (dense, i.e. without 2:4 sparsity) ----------------------------------

# Source: NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TFLOPS, tensor (FP16) 125 TFLOPS,
# 16 GB HBM2 at 900 GB/s. No bf16 support: bf16 falls back to the fp32 rate.
V100_SXM2_16GB = DeviceSpec(
    name="V100-16GB",
    peak_flops=(("fp32", 15.7 * TFLOPS), ("fp16", 125 * TFLOPS)),
    vector_flops=15.7 * TFLOPS,
    memory_bytes=16 * GiB,
    memory_bandwidth=900 * GBps,
    source="NVIDIA Tesla V100 datasheet (SXM2)",
)

# Source: NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5, TF32 156, BF16/FP16 312
# TFLOPS dense; 80 GB HBM2e at 2,039 GB/s.
A100_SXM4_80GB = DeviceSpec(
    name="A100-80GB",
    peak_flops=(("fp32", 19.5 * TFLOPS), ("tf32", 156 * TFLOPS), ("bf16", 312 * TFLOPS),
                ("fp16", 312 * TFLOPS)),
    vector_flops=19.5 * TFLOPS,
    memory_bytes=80 * GiB,
    memory_bandwidth=2039 * GBps,
    source="NVIDIA A100 datasheet (SXM4 80GB)",
)

# Source: same datasheet, SXM4 40GB: 1,555 GB/s HBM2.
A100_SXM4_40GB = A100_SXM4_80GB.replace(
    name="A100-40GB", memory_bytes=40 * GiB, memory_bandwidth=1555 * GBps,
    source="NVIDIA A100 datasheet (SXM4 40GB)",
)

# Source: NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67, TF32 494.7, BF16/FP16 989.4,
# FP8 1,978.9 TFLOPS dense (the datasheet's headline numbers are 2x these, with sparsity);
# 80 GB HBM3 at 3.35 TB/s.
H100_SXM5_80GB = DeviceSpec(
    name="H100-80GB",
    peak_flops=(("fp32", 67 * TFLOPS), ("tf32", 494.7 * TFLOPS), ("bf16", 989.4 * TFLOPS),
                ("fp16", 989.4 * TFLOPS), ("fp8", 1978.9 * TFLOPS)),
    vector_flops=67 * TFLOPS,
    memory_bytes=80 * GiB,
    memory_bandwidth=3350 * GBps,
    source="NVIDIA H100 datasheet (SXM5)",
)

# Source: NVIDIA H200 datasheet (SXM): compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s.
H200_SXM_141GB = H100_SXM5_80GB.replace(
    name="H200-141GB", memory_bytes=141 * GiB, memory_bandwidth=4800 * GBps,
    source="NVIDIA H200 datasheet (SXM)",
)

# Source: NVIDIA GH200 Grace Hopper Superchip datasheet: the Hopper GPU's compute as H100 SXM;
# 96 GB HBM3 at 4 TB/s.
GH200_96GB = H100_SXM5_80GB.replace(
    name="GH200-96GB", memory_bytes=96 * GiB, memory_bandwidth=4000 * GBps,
    source="NVIDIA GH200 Grace Hopper Superchip datasheet",
)

# --- CPU ------------------------------------------------------------------------------------------

# One x86 server core with AVX-512: 2 FMA units x 16 fp32 lanes x 2 FLOP x 2.5 GHz = 160 GFLOP/s
# nominal (Intel Xeon Scalable, Cascade Lake); ~10 GB/s of DRAM bandwidth per core. These are
# order-of-magnitude placeholders: `autopar profile` measures the real machine.
CPU_CORE_FP32_FLOPS = 160e9
CPU_CORE_MEMORY_BANDWIDTH = 10 * GBps
# PyTorch eager dispatch on CPU costs a few microseconds per op.
CPU_OP_OVERHEAD = 5e-6
DEFAULT_CPU_EFFICIENCY = (
    ("matmul", 0.5), ("conv", 0.35), ("attention", 0.3), ("elementwise", 0.8), ("softmax", 0.4),
    ("normalization", 0.4), ("reduction", 0.6), ("indexing", 0.4), ("copy", 0.8),
)


def cpu_spec(*, threads: int = 1, memory_bytes: int, name: str | None = None) -> DeviceSpec:
    """A CPU rank using ``threads`` cores and ``memory_bytes`` of RAM (analytic constants)."""
    if threads < 1:
        raise ClusterError(f"a CPU rank needs at least one thread, got {threads}")
    return DeviceSpec(
        name=name or f"CPU-{threads}t",
        peak_flops=(("fp32", CPU_CORE_FP32_FLOPS * threads),),
        vector_flops=CPU_CORE_FP32_FLOPS * threads / 4,
        memory_bytes=int(memory_bytes),
        memory_bandwidth=CPU_CORE_MEMORY_BANDWIDTH * threads,
        efficiency=DEFAULT_CPU_EFFICIENCY,
        matmul_half_dim=32.0,
        op_overhead=CPU_OP_OVERHEAD,
        kind="cpu",
        threads=threads,
        source="analytic placeholder (see CPU_CORE_FP32_FLOPS); run `autopar profile` to measure",
    )


DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (V100_SXM2_16GB, A100_SXM4_80GB, A100_SXM4_40GB, H100_SXM5_80GB, H200_SXM_141GB, GH200_96GB)
}
_ALIASES = {"V100": "V100-16GB", "A100": "A100-80GB", "H100": "H100-80GB", "H100-SXM": "H100-80GB",
            "H200": "H200-141GB", "GH200": "GH200-96GB"}


def device_spec(name: str) -> DeviceSpec:
    """The named device spec (``"A100-80GB"``, ``"H100-80GB"``, ...); raises ClusterError otherwise."""
    key = _ALIASES.get(name, name)
    if key not in DEVICES:
        raise ClusterError(
            f"unknown device {name!r}; use one of {sorted(DEVICES)} or pass a DeviceSpec"
            " (autopar.cost_models.devices.DeviceSpec)"
        )
    return DEVICES[key]


__all__ = ["DEVICES", "DeviceSpec", "OP_CLASSES", "cpu_spec", "device_spec", "dtype_name"]
