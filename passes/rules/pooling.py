"""Sharding rules for pooling (max, average, adaptive; 1-, 2-, 3-d).

A pool works on the trailing spatial dims of ``[N, C, *spatial]`` (or unbatched
``[C, *spatial]``) independently per leading index, so one mesh axis can shard any leading dim
(batch or channel): input and every output (max pools' indices too, which count positions inside
one spatial plane) sharded alike. Average pools are linear, so a ``Partial`` floating-point input
gives a ``Partial`` output; max pools are not. Spatial sharding needs halos: not offered.
"""

from __future__ import annotations

import torch

from autopar.core.ir import OpSpec
from autopar.core.placement import P, Shard
from autopar.passes.rules.registry import AxisOption, register

aten = torch.ops.aten


def pool_options(spec: OpSpec, *, spatial: int, linear: bool) -> list[AxisOption]:
    """Options of a pool over ``spatial`` trailing dims; ``linear`` for average pools."""
    (x,) = spec.inputs
    n_out = len(spec.outputs)
    options = [
        AxisOption((Shard(d),), (Shard(d),) * n_out) for d in range(x.ndim - spatial) if x.shape[d] > 1
    ]
    if linear and x.dtype.is_floating_point:
        options.append(AxisOption((P,), (P,) * n_out))
    return options


def _rule(spatial: int, linear: bool):
    def rule(spec: OpSpec) -> list[AxisOption]:
        return pool_options(spec, spatial=spatial, linear=linear)

    return rule


# ---- samples the rule checker runs: batch and channels divisible by 8 ----
# float64 for average pools: a Partial input is split into random unit-size addends whose
# float32 rounding after averaging can exceed the checker's tolerance on the 3-axis mesh.


def _r(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def _samples(spatial: int, *, extra_args=()):
    def samples():
        spatial_shape = (6,) * spatial
        yield (_r(8, 8, *spatial_shape), *extra_args), {}
        yield (_r(8, *spatial_shape), *extra_args), {}  # unbatched
        yield (_r(8, 1, *spatial_shape, dtype=torch.float32), *extra_args), {}

    return samples


# op -> (spatial dims, linear, args after the input for the samples)
_POOLS = {
    aten.max_pool1d.default: (1, False, ([3], [2], [1])),
    aten.max_pool2d.default: (2, False, ([3, 3], [2, 2], [1, 1])),
    aten.max_pool3d.default: (3, False, ([2, 2, 2],)),
    aten.max_pool2d_with_indices.default: (2, False, ([3, 3], [2, 2], [1, 1])),
    aten.max_pool3d_with_indices.default: (3, False, ([2, 2, 2],)),
    aten.adaptive_max_pool1d.default: (1, False, ([4],)),
    aten.adaptive_max_pool2d.default: (2, False, ([4, 3],)),
    aten.avg_pool1d.default: (1, True, ([3], [2], [1])),
    aten.avg_pool2d.default: (2, True, ([3, 3], [2, 2], [1, 1], True, False)),
    aten.avg_pool3d.default: (3, True, ([2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, 3)),
    aten.adaptive_avg_pool1d.default: (1, True, ([4],)),
    aten.adaptive_avg_pool2d.default: (2, True, ([4, 1],)),
    aten._adaptive_avg_pool2d.default: (2, True, ([4, 4],)),
    aten.adaptive_avg_pool3d.default: (3, True, ([1, 2, 3],)),
    aten._adaptive_avg_pool3d.default: (3, True, ([2, 2, 2],)),
}

for _op, (_spatial, _linear, _args) in _POOLS.items():
    register(_op, samples=_samples(_spatial, extra_args=_args))(_rule(_spatial, _linear))
