"""Gradient clipping over every shard and stage, as ``torch.nn.utils.clip_grad_norm_`` on the
whole model in one process.

The whole model's ``norm ** p`` is the sum of ``|g| ** p`` over the distinct pieces of every
gradient. Each rank sums its own pieces, counting a piece only where it is the representative
of its copies: at coordinate 0 of every mesh axis the parameter is replicated on (the ranks along
such an axis hold the same piece), and on one stage of a pipeline for a parameter several stages
hold. One all-reduce over every rank then gives the total (a maximum for ``norm_type=inf``), and
every rank scales all its gradients, copies included, by the same factor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.comm.mesh import RankMesh
from autopar.core.placement import Shard

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def _represents(sharding, mesh: RankMesh) -> bool:
    """Whether this rank counts its piece: it is at coordinate 0 of every mesh axis of size > 1
    that the tensor is not sharded on."""
    return all(isinstance(p, Shard) or n == 1 or c == 0
               for p, n, c in zip(sharding, mesh.mesh_shape, mesh.coord))


def clip_grad_norm_(entries, max_norm: float, norm_type: float = 2.0, *, mesh: RankMesh,
                    device: torch.device | None = None) -> torch.Tensor:
    """Clip the gradients of ``entries`` — ``(parameter, storage sharding on mesh, counted)`` for
    every trainable parameter this rank holds, ``counted`` False for a copy another stage counts —
    to a total norm of ``max_norm``; returns the total norm (0-dim tensor on ``device``, where the
    collective runs, default: the gradients'; collective over the default group). Gradients on
    the host (an offloaded optimizer's) are scaled there."""
    p = float(norm_type)
    grads = [(param.grad, sharding, counted) for param, sharding, counted in entries if param.grad is not None]
    device = device or (grads[0][0].device if grads else torch.device("cpu"))
    parts = [torch.linalg.vector_norm(g, p, dtype=torch.float32).to(device) for g, sharding, counted in grads
             if counted and (math.isinf(p) or _represents(sharding, mesh))]
    if math.isinf(p):
        total = torch.stack(parts).max() if parts else torch.zeros((), device=device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        total = torch.stack(parts).pow(p).sum() if parts else torch.zeros((), device=device)
        dist.all_reduce(total)
        total = total.pow(1.0 / p)
    scale = torch.clamp(max_norm / (total + _EPS), max=1.0)
    with torch.no_grad():
        for g, _, _ in grads:
            g.mul_(scale.to(g.device, g.dtype))
    return total


__all__ = ["clip_grad_norm_"]
