"""A CPU rank returns a freed large buffer to the system, where glibc's defaults keep it."""

import subprocess
import sys

import pytest

from autopar.runtime.host_allocator import _mallopt, return_freed_memory

RETAINED = """
import sys, torch
from autopar.runtime.host_allocator import return_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
if sys.argv[1] == "policy":
    assert return_freed_memory("cpu")
x = torch.ones(6 * 2**20); del x   # 24 MiB, mapped, then freed: glibc's mmap threshold rises to it
before = rss()
a = torch.ones(4 * 2**20)          # 16 MiB: from the heap under the risen threshold
b = torch.ones(2**18)              # 1 MiB above it
del a                              # freed below b: the heap's top cannot be trimmed past b
print((rss() - before) / 2**20)
"""


def _retained_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(_mallopt() is None, reason="the C library is not glibc")
def test_a_freed_buffer_leaves_the_resident_set_under_the_policy():
    assert _retained_mib("default") > 12  # the 16 MiB buffer stays resident under glibc's defaults
    assert _retained_mib("policy") < 4  # only the 1 MiB buffer still alive


def test_the_policy_is_for_cpu_ranks_only():
    assert not return_freed_memory("meta")
