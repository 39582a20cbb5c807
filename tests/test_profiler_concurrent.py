"""CPU ranks are profiled computing at the same time, as they do in a training step.

``merge_compute`` keeps the slowest rank's time per case; ``time_calls(sync=...)`` calls the
barrier once before every sample (so that the ranks' samples overlap); ``profile_cluster``
measures a CPU cluster of several ranks that way.
"""

from __future__ import annotations

import pytest

import autopar.profiler as profiler
from autopar.core.errors import ClusterError
from autopar.cost_models.cluster import Cluster
from autopar.profiler import database


def _measured(seconds, overhead):
    return {"overhead": overhead, "device": "cpu", "threads": 1, "dtype": "torch.float32",
            "cases": [{"class": "matmul", "label": f"mm {i}", "flops": 1e6 * (i + 1), "bytes": 1e3,
                       "min_dim": 64, "seconds": s} for i, s in enumerate(seconds)]}


def test_merge_keeps_the_slowest_rank_per_case():
    merged = profiler.merge_compute([_measured([1.0, 5.0, 2.0], 3e-6), _measured([2.0, 4.0, 2.5], 2e-6)])
    assert [r["seconds"] for r in merged["cases"]] == [2.0, 5.0, 2.5]
    assert merged["overhead"] == 3e-6
    assert merged["ranks"] == 2
    assert [r["label"] for r in merged["cases"]] == ["mm 0", "mm 1", "mm 2"]


def test_merge_refuses_ranks_that_measured_different_cases():
    other = _measured([1.0, 2.0], 1e-6)
    other["cases"][1]["label"] = "conv"
    with pytest.raises(ClusterError, match="different compute cases"):
        profiler.merge_compute([_measured([1.0, 2.0], 1e-6), other])


def test_time_calls_syncs_before_every_sample():
    calls = []
    profiler.time_calls([lambda: None, lambda: None], repeats=3, min_sample=1e-5, sync=lambda: calls.append(1))
    assert len(calls) == 2 * 3


def test_cpu_cluster_of_two_ranks_measures_compute_on_both_at_once(monkeypatch, tmp_path):
    seen = {}

    def fake_concurrent(*, ranks, **kwargs):
        seen["ranks"] = ranks
        raise RuntimeError("stop after the compute step")

    monkeypatch.setattr(database, "measure_compute_concurrently", fake_concurrent)
    with pytest.raises(RuntimeError, match="stop"):
        profiler.profile(Cluster.local(world_size=2, use_profile=False), cache_dir=tmp_path, progress=lambda *_: None)
    assert seen["ranks"] == 2
