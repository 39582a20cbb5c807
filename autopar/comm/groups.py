"""Process groups over lists of ranks, made once per default group and held by name only.

autopar never keeps a ``ProcessGroup`` object beyond a call: a group somebody still holds after
``torch.distributed.destroy_process_group()`` keeps gloo's worker threads running into
interpreter shutdown, and a worker that is just releasing a finished collective (whose tensors
belong to Python) then needs the GIL, which a finalizing interpreter refuses with
``pthread_exit``, and the process aborts ("terminate called without an active exception").
Held by name, a group is released by ``destroy_process_group``, which joins its threads.

    names = group_names([[0, 1], [2, 3]])   # on every rank, same order (collective)
    group = resolve(names[0])               # this rank's group, or None where it is no member
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_CACHE: dict = {}  # rank lines -> (weak reference to the default group, names)


def group_names(lines) -> tuple[str | None, ...]:
    """For each list of ranks in ``lines``, the name of its process group when this rank is in
    it, else None. Collective: every rank calls with the same lines in the same order; groups are
    made once per default process group."""
    key = tuple(tuple(int(r) for r in line) for line in lines)
    world = dist.group.WORLD
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is world:
        return hit[1]
    me = dist.get_rank()
    names = []
    for line in key:
        group = dist.new_group(sorted(line))
        names.append(group.group_name if me in line else None)
    _CACHE[key] = (weakref.ref(world), tuple(names))
    return _CACHE[key][1]


def resolve(name: str | None):
    """The live process group called ``name`` (None for None)."""
    return None if name is None else _resolve_process_group(name)


__all__ = ["group_names", "resolve"]
