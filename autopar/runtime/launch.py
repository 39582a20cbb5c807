"""Rank processes on this machine: the one way autopar starts them (testing helpers, the
profiler, the property tests).

    results = run_on_ranks(fn, world_size=2, args=(x,))   # fn(x) on 2 gloo ranks, rank 0's first

    with LocalRanks(serve, world_size=4, args=(queues,)) as ranks:   # ranks running meanwhile
        ...
        ranks.finished()       # True once every rank has returned; LaunchError if one failed

Each rank is a new process with torchrun's environment (``MASTER_ADDR`` 127.0.0.1 and a
free ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), ``threads`` intra-op threads
and the default process group initialised (gloo, or NCCL on GPU ``rank``). It calls
``fn(*args)``, hands the result back, waits for the other ranks and destroys the process group
(unless ``fn`` did). A rank that fails stops the others and raises :class:`LaunchError` with the
traceback of every rank that raised; rank processes are daemons, so none outlives the process
that started it.

Ranks are forked from multiprocessing's fork server (where the platform has one), which has
imported torch and autopar once: a spawned interpreter per rank imported them again for every run
(5-10 s a rank on a loaded 2-core machine, often longer than the run), and a rank forked from a
server with torch alone still imported autopar (starting 2 ranks: 2-4 s, against 0.1-0.2 s now). As with
``spawn``, a rank starts from the caller's ``sys.path`` and imports its main module, so a script
still starts ranks under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.core.errors import AutoparError

GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # a collective that waits longer fails
POLL_SECONDS = 0.2
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# what the fork server imports once for every rank: torch and autopar's runtime and testing
# helpers, then it freezes the collector's view of them (autopar.rank_preload)
PRELOAD = ["torch", "torch.distributed", "autopar.rank_preload"]


class LaunchError(AutoparError):
    """A local rank failed (the message holds the traceback of every rank that raised) or the
    ranks ran out of time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, backend, threads, call, out_dir):
    try:
        fn, args = call[0], tuple(a.load() if isinstance(a, _Saved) else a for a in call[1])
        _run_rank(rank, world_size, port, backend, threads, fn, args, out_dir)
    except BaseException:  # for LaunchError's message, which shows every rank that raised
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run_rank(rank, world_size, port, backend, threads, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():  # fn may have destroyed the process group itself
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Saved:
    """An argument saved by value (``torch.save``: tensors that share a storage keep sharing it)
    for the ranks to load. multiprocessing's pickler would hand every tensor storage over as a
    file descriptor, and the fork server takes fewer than 256 per process."""

    def __init__(self, data: bytes):
        self.data = data

    @classmethod
    def of(cls, arg):
        """``arg`` saved, or ``arg`` itself where only multiprocessing's pickler hands it over
        (a queue)."""
        buffer = io.BytesIO()
        try:
            torch.save(arg, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001  (not savable: multiprocessing's pickler says why, or passes it)
            return arg
        return cls(buffer.getvalue())

    def load(self):
        return torch.load(io.BytesIO(self.data), weights_only=False)


class LocalRanks:
    """``world_size`` rank processes, started at once, each calling ``fn(*args)`` (see the module
    docstring); ``fn`` must be importable (a module-level function) and its arguments and result
    picklable. As a context manager, leaving the block stops the ranks still running."""

    def __init__(self, fn, *, world_size: int, args=(), backend: str = "gloo", threads: int = 1):
        self.world_size = world_size
        self._out = tempfile.mkdtemp(prefix="autopar-ranks-")
        call = (fn, tuple(_Saved.of(a) for a in args))
        args = (world_size, free_port(), backend, threads, call, self._out)
        if START_METHOD == "forkserver":
            multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (once)
        self._context = mp.start_processes(_rank_main, args=args, nprocs=world_size, join=False, daemon=True,
                                           start_method=START_METHOD)

    def finished(self, timeout: float = 0.0) -> bool:
        """Whether every rank has returned, waiting up to ``timeout`` seconds for it; a rank that
        failed stops the others and raises :class:`LaunchError`."""
        try:
            return self._context.join(timeout=timeout)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            errors = self._tracebacks() or str(exc)  # a rank killed by a signal leaves none
            self.close()
            raise LaunchError(f"a rank failed:\n{errors}") from None

    def _tracebacks(self) -> str:
        """The tracebacks of the ranks that raised, rank by rank: the first rank to fail is often
        one that lost a peer in a collective, and the cause is in another's."""
        out = []
        for r in range(self.world_size):
            path = os.path.join(self._out, f"rank{r}.error")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(f"-- rank {r}:\n{f.read()}")
        return "".join(out)

    def wait(self, timeout: float, *, meanwhile=None) -> list:
        """Each rank's result, rank 0 first, once every rank has returned; :class:`LaunchError`
        when a rank fails or they run past ``timeout`` seconds. ``meanwhile()`` is called about
        every 0.2 s while waiting (e.g. to show what the ranks report) and once at the end."""
        deadline = time.monotonic() + timeout
        while not self.finished(POLL_SECONDS):
            if meanwhile is not None:
                meanwhile()
            if time.monotonic() > deadline:
                self.close()
                raise LaunchError(f"the ranks did not finish within {timeout} s")
        if meanwhile is not None:
            meanwhile()
        return [torch.load(os.path.join(self._out, f"rank{r}.pt")) for r in range(self.world_size)]

    def close(self, grace: float = 0.0) -> None:
        """Wait up to ``grace`` seconds for the ranks to end, kill those still running, and
        delete their results."""
        deadline = time.monotonic() + grace
        for process in self._context.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(self._out, ignore_errors=True)

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_on_ranks(fn, *, world_size: int, args=(), timeout: float = 300.0, backend: str = "gloo",
                 threads: int = 1, meanwhile=None) -> list:
    """Call ``fn(*args)`` on ``world_size`` local ranks (:class:`LocalRanks`) and return each
    rank's result, rank 0 first (:meth:`LocalRanks.wait`: ``timeout``, ``meanwhile``)."""
    with LocalRanks(fn, world_size=world_size, args=args, backend=backend, threads=threads) as ranks:
        return ranks.wait(timeout, meanwhile=meanwhile)


__all__ = ["LaunchError", "LocalRanks", "free_port", "run_on_ranks"]
