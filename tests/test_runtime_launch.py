"""The one rank launcher (:mod:`autopar.runtime.launch`): each rank runs with torchrun's
environment and a process group, results come back in rank order, a function may destroy the
process group itself, and a failing or hanging rank raises LaunchError (with the failed rank's
traceback) instead of hanging the caller."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from autopar.core.errors import AutoparError
from autopar.runtime.launch import LaunchError, run_on_ranks

pytestmark = pytest.mark.slow  # rank processes


def _describe(destroy: bool):
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    if destroy:
        dist.destroy_process_group()
    return dist.get_rank() if dist.is_initialized() else None, env, float(total), torch.get_num_threads()


@pytest.mark.parametrize("destroy", [False, True])
def test_ranks_run_in_a_process_group_and_return_in_rank_order(destroy):
    got = run_on_ranks(_describe, world_size=2, args=(destroy,), threads=1)
    for rank, (seen_rank, env, total, threads) in enumerate(got):
        assert seen_rank == (None if destroy else rank)
        assert env == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}
        assert total == 3.0 and threads == 1


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # rank 0 would wait here for the group timeout if nobody stopped it


def test_a_failing_rank_raises_its_traceback_and_stops_the_others():
    start = time.monotonic()
    cause = "(?s)a rank failed:.*-- rank 1:\nTraceback.*ValueError: rank one gives up"
    with pytest.raises(LaunchError, match=cause) as err:
        run_on_ranks(_fail_on_rank_one, world_size=2, timeout=100)
    assert isinstance(err.value, AutoparError) and "_fail_on_rank_one" in str(err.value)
    assert time.monotonic() - start < 60  # not the 120 s group timeout, nor the 100 s limit


def _sleep():
    time.sleep(600)


def test_ranks_past_the_timeout_are_stopped():
    with pytest.raises(LaunchError, match="did not finish within 5 s"):
        run_on_ranks(_sleep, world_size=2, timeout=5)
