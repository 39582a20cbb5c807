"""The Plan's typed records: its Options and its Cluster survive the JSON round trip exactly,
the summary reads them as fields, and plans of the previous schema are refused with a re-plan hint."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import Cluster
from autopar.core.errors import PlanError
from autopar.core.options import Options
from autopar.cost_models.calibration import Calibration
from autopar.cost_models.communication import CollectiveFit, Link
from autopar.cost_models.devices import cpu_spec
from autopar.plan import SCHEMA_VERSION, Plan
from autopar.plan.report import GiB, memory_limit
from plan_builders import golden

OPTIONS = Options(memory_fraction=0.7, optimizer="sgd", mixed_precision=True, shard_parameters=False,
                  time_limit_s=5.0, backend="cpsat", relative_gap=0.01, share_layers=False, pipeline=False,
                  micro_batches=2, schedule="gpipe", recompute=False, search_meshes=False, stage_meshes="any")


def custom_cluster(mesh_shape) -> Cluster:
    """Every part a Cluster serialises: a DeviceSpec device, links per axis, a calibration whose
    device tables are given out of alphabetical order, a name."""
    device = cpu_spec(threads=2, memory_bytes=3 * 2**30, name="CPU-custom")
    calibrated = dataclasses.replace(device, efficiency=(("matmul", 0.7), ("copy", 0.9), ("conv", 0.2)),
                                     class_overhead=(("conv", 2e-5), ("attention", 1e-6)))
    calibration = Calibration(key="cpu-custom/8", device=calibrated, collectives=(
        CollectiveFit("all_reduce", 2, "intra", 3e-4, 1e-9), CollectiveFit("all_gather", 4, "intra", 2e-4, 2e-9)))
    links = tuple(Link(bandwidth=1e9 * (a + 1), latency=1e-5 / (a + 1)) for a in range(len(mesh_shape)))
    return Cluster(mesh_shape=mesh_shape, device=device, devices_per_node=8, axis_links=links,
                   calibration=calibration, name="custom")


@pytest.fixture(scope="module")
def plan() -> Plan:
    base = golden("mlp")  # made for A100s: on the custom CPUs its step takes 100 times longer
    slower = dataclasses.replace(base.time, compute=100 * base.time.compute)
    return dataclasses.replace(base, cluster=custom_cluster(base.mesh_shape), options=OPTIONS, time=slower)


def test_a_plan_with_custom_options_and_cluster_round_trips_through_json_exactly(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.options == OPTIONS and loaded.cluster == plan.cluster
    assert loaded.cluster.axis_links == plan.cluster.axis_links
    assert loaded.cluster.calibration == plan.cluster.calibration
    assert loaded.cluster.collective_time("all_reduce", 1e6, 0) == plan.cluster.collective_time("all_reduce", 1e6, 0)
    saved = json.loads(path.read_text())
    assert saved["schema_version"] == SCHEMA_VERSION
    assert saved["options"] == dataclasses.asdict(OPTIONS)
    assert saved["cluster"]["axis_links"] == [dataclasses.asdict(x) for x in plan.cluster.axis_links]


def test_the_summary_reads_the_typed_options_and_cluster(plan):
    text = " ".join(plan.summary().split())  # unwrapped
    assert "= 8 x CPU-custom (custom)" in text and "sgd optimizer, mixed precision" in text
    assert memory_limit(plan) == 0.7 * 3 * 2**30
    assert f"(limit {0.7 * 3:.1f} GiB)" in text
    assert memory_limit(golden("mlp")) == 0.9 * 80 * GiB  # A100-80GB, default memory_fraction


def test_a_plan_of_the_previous_schema_is_refused_with_a_re_plan_hint(plan):
    old = plan.to_dict() | {"schema_version": SCHEMA_VERSION - 1}
    with pytest.raises(PlanError, match=f"older autopar .plan schema version {SCHEMA_VERSION - 1}.*re-plan"):
        Plan.from_dict(old)


@pytest.mark.parametrize("field, value", [("cluster", {"mesh_shape": [4, 2]}), ("options", {"optimizer": "sgd"})])
def test_a_plan_holds_a_cluster_and_options_not_dicts(plan, field, value):
    with pytest.raises(PlanError, match=f"Plan.{field} must be"):
        dataclasses.replace(plan, **{field: value})


def test_saved_options_outside_their_range_are_a_malformed_plan(plan):
    data = plan.to_dict()
    data["options"]["schedule"] = "zigzag"
    with pytest.raises(PlanError, match="malformed.*schedule must be one of"):
        Plan.from_dict(data)


def test_a_plan_faster_than_its_cluster_peak_cannot_be_made():
    base = golden("mlp")
    floor = base.flops_per_step / base.peak_flops  # seconds at 100 % MFU, in the plan's precision
    assert base.precision == "fp32" and base.peak_flops == 8 * 19.5e12 and 0 < base.mfu < 1
    fast = dataclasses.replace(base.time, compute=0.0, communication=0.0, resharding=0.0, bubble=floor * 0.99)
    with pytest.raises(PlanError, match="101% MFU, and no plan beats 100 %"):
        dataclasses.replace(base, time=fast)
    dataclasses.replace(base, time=dataclasses.replace(fast, bubble=floor))  # exactly 100 % is possible
