"""Every emitted collective, forward and each backward variant, on two gloo ranks.

Rank ``r`` holds ``A_r`` and back-propagates ``G_r`` (both drawn from seeds, so the parent can
rebuild every rank's data); the parent checks each rank's output and input gradient against
the formula the collective stands for.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.comm import collectives as C
from autopar.comm.mesh import rank_mesh
from autopar.testing import run_on_ranks

pytestmark = pytest.mark.slow  # rank processes


def _a(rank, shape=(4, 6)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank))


def _g(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


CASES = {  # name: (function, kwargs)
    "all_reduce/identity": (C.autopar_all_reduce, dict(backward="identity")),
    "all_reduce/all_reduce": (C.autopar_all_reduce, dict(backward="all_reduce")),
    "reduce_scatter": (C.autopar_reduce_scatter, dict(dim=1)),
    "all_gather/slice": (C.autopar_all_gather, dict(dim=0, backward="slice")),
    "all_gather/reduce_scatter": (C.autopar_all_gather, dict(dim=0, backward="reduce_scatter")),
    "chunk/all_gather": (C.autopar_chunk, dict(dim=1, backward="all_gather")),
    "chunk/zero_pad": (C.autopar_chunk, dict(dim=1, backward="zero_pad")),
    "all_to_all": (C.autopar_all_to_all, dict(dim=0, dim2=1)),
    "to_partial/identity": (C.autopar_to_partial, dict(backward="identity")),
    "to_partial/mask": (C.autopar_to_partial, dict(backward="mask")),
    "grad_all_reduce": (C.autopar_grad_all_reduce, {}),
    "grad_to_partial": (C.autopar_grad_to_partial, {}),
}


def _run_all():
    rank = dist.get_rank()
    mesh = rank_mesh((2,))
    out = {}
    with C.use_mesh(mesh):
        for name, (fn, kwargs) in CASES.items():
            x = _a(rank).requires_grad_()
            y = fn(x, axis=0, **kwargs)
            y.backward(_g(rank, tuple(y.shape)))
            out[name] = (y.detach(), x.grad)
        flags = _a(rank) > 0
        out["bool_gather"] = (C.autopar_all_gather(flags, axis=0, dim=1), None)
        z = _z(rank)  # complex activations (Meta-style rotary): torch.distributed sends them as real views
        out["complex"] = (C.autopar_all_gather(z, axis=0, dim=-1), C.autopar_all_reduce(z, axis=0, backward="identity"),
                          C.autopar_all_to_all(z, axis=0, dim=0, dim2=1), C.autopar_reduce_scatter(z, axis=0, dim=1))
    return out


def _z(rank):
    return torch.complex(_a(rank), _a(10 + rank))


def _expected(name, r):
    a0, a1, a = _a(0), _a(1), _a(r)
    if name.startswith("all_reduce"):
        grad = _g(0, (4, 6)) + _g(1, (4, 6)) if name == "all_reduce/all_reduce" else _g(r, (4, 6))
        return a0 + a1, grad
    if name == "reduce_scatter":
        return (a0 + a1)[:, 3 * r:3 * r + 3], torch.cat([_g(0, (4, 3)), _g(1, (4, 3))], 1)
    if name.startswith("all_gather"):
        g0, g1 = _g(0, (8, 6)), _g(1, (8, 6))
        grad = (g0 + g1) if name.endswith("reduce_scatter") else _g(r, (8, 6))
        return torch.cat([a0, a1], 0), grad[4 * r:4 * r + 4]
    if name.startswith("chunk"):
        if name.endswith("all_gather"):
            grad = torch.cat([_g(0, (4, 3)), _g(1, (4, 3))], 1)
        else:
            grad = torch.zeros(4, 6)
            grad[:, 3 * r:3 * r + 3] = _g(r, (4, 3))
        return a[:, 3 * r:3 * r + 3], grad
    if name == "all_to_all":
        full = torch.cat([a0, a1], 0)
        full_grad = torch.cat([_g(0, (8, 3)), _g(1, (8, 3))], 1)
        return full[:, 3 * r:3 * r + 3], full_grad[4 * r:4 * r + 4]
    g = _g(r, (4, 6))
    if name.startswith("to_partial"):
        grad = g if name.endswith("identity") or r == 0 else torch.zeros(4, 6)
        return (a if r == 0 else torch.zeros(4, 6)), grad
    if name == "grad_all_reduce":
        return a, _g(0, (4, 6)) + _g(1, (4, 6))
    if name == "grad_to_partial":
        return a, (g if r == 0 else torch.zeros(4, 6))
    raise AssertionError(name)


def test_each_collective_and_backward_variant_on_two_ranks():
    results = run_on_ranks(_run_all, world_size=2)
    for r, out in enumerate(results):
        for name in CASES:
            y, grad = out[name]
            want_y, want_grad = _expected(name, r)
            torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6, msg=f"rank {r} {name} forward")
            torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6, msg=f"rank {r} {name} backward")
        flags, _ = out["bool_gather"]
        assert flags.dtype == torch.bool
        assert torch.equal(flags, torch.cat([_a(0) > 0, _a(1) > 0], 1))
        gathered, summed, moved, scattered = out["complex"]
        z0, z1 = _z(0), _z(1)
        assert torch.equal(gathered, torch.cat([z0, z1], 1))
        torch.testing.assert_close(summed, z0 + z1)
        assert torch.equal(moved, torch.cat([z0, z1], 0)[:, 3 * r:3 * r + 3])
        torch.testing.assert_close(scattered, (z0 + z1)[:, 3 * r:3 * r + 3])
