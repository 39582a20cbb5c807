"""How a rank whose device is the CPU gets its freed memory back to the operating system.

glibc's malloc keeps freed blocks for reuse: a large buffer under its dynamic mmap threshold
(which grows up to 32 MiB as large blocks are freed) stays in the heap after ``free``, and the
heap's top is trimmed only past 128 KiB of slack. A training step frees gathered parameters,
whole gradients and activations in an order the heap cannot coalesce, so a CPU rank's resident
set kept about 1.5 GiB more than the plan's peak on a 1.6 B model under FSDP on 4 ranks
(``benchmarks/big_start.py``). With every block of 1 MiB or more mapped on its own (returned
to the system when freed) and the top trimmed past 1 MiB, the resident set follows the
program's own tensors. CUDA ranks allocate through torch's caching allocator instead; nothing
changes there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
RETURN_FROM_BYTES = 1 << 20


@functools.cache
def _mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None


def return_freed_memory(device) -> bool:
    """On a CPU ``device``, have malloc map blocks of :data:`RETURN_FROM_BYTES` or more on their
    own and trim its heap past that slack (this process, from now on). Whether the policy is set."""
    mallopt = _mallopt()
    if torch.device(device).type != "cpu" or mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, RETURN_FROM_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, RETURN_FROM_BYTES))
