"""autopar.Cluster: presets, validation, mesh views, axis spans, collective times by hand."""

import pytest

import autopar
from autopar import Cluster, ClusterError
from autopar.cost_models.communication import Link
from autopar.cost_models.devices import DeviceSpec, cpu_spec

GiB = 2**30


def test_design_doc_constructor_and_defaults():
    c = Cluster(mesh_shape=(2, 8), device="A100-80GB", intra_node_bandwidth=300e9,
                inter_node_bandwidth=25e9, device_memory=None)
    assert c.num_devices == 16 and c.num_nodes == 2 and c.devices_per_node == 8
    assert c.memory_per_device == 80 * GiB
    assert c.links == (Link(25e9, c.inter_node_latency), Link(300e9, c.intra_node_latency))
    assert Cluster(mesh_shape=(8,), device="H100", device_memory=40e9).memory_per_device == 40e9
    assert autopar.Cluster is Cluster


@pytest.mark.parametrize("name, device, intra, inter_per_device", [
    ("dgx-v100", "V100-16GB", 150e9, 25e9 / 8 / 8),   # 25 Gbit/s per node, 8 GPUs share it
    ("dgx-a100", "A100-80GB", 300e9, 25e9),            # 8x HDR 200 Gbit/s: one per GPU
    ("dgx-h100", "H100-80GB", 450e9, 50e9),            # 8x NDR 400 Gbit/s: one per GPU
])
def test_presets(name, device, intra, inter_per_device):
    c = Cluster.preset(name, nodes=2)
    assert c.mesh_shape == (2, 8) and c.device_spec.name == device
    assert c.links[1].bandwidth == intra
    assert c.links[0].bandwidth == pytest.approx(inter_per_device)
    assert c.axis_span(0) == (1, 2) and c.axis_span(1) == (8, 1)


def test_preset_device_specs():
    a100 = Cluster.preset("dgx-a100").device_spec
    assert a100.peak("bf16") == 312e12 and a100.peak("fp32") == 19.5e12
    assert a100.memory_bandwidth == 2039e9
    h100 = Cluster.preset("dgx-h100").device_spec
    assert h100.peak("bf16") == pytest.approx(989.4e12) and h100.memory_bytes == 80 * GiB
    v100 = Cluster.preset("dgx-v100").device_spec
    assert v100.peak("fp16") == 125e12 and v100.peak("bf16") == v100.peak("fp32")  # no bf16 units


def test_with_mesh_views_the_same_devices():
    c = Cluster.preset("dgx-a100", nodes=2)
    square = c.with_mesh((4, 4))
    assert square.num_devices == 16 and square.devices_per_node == 8
    assert square.axis_span(1) == (4, 1)        # ranks 0-3: one node
    assert square.axis_span(0) == (2, 2)        # ranks 0,4 | 8,12: two per node, two nodes
    three = Cluster.preset("dgx-h100", nodes=4, mesh_shape=(2, 2, 8))
    assert [three.axis_span(a) for a in range(3)] == [(1, 2), (1, 2), (8, 1)]
    with pytest.raises(ClusterError, match="product is 16"):
        c.with_mesh((3, 5))


def test_collective_time_by_hand():
    c = Cluster.preset("dgx-a100", nodes=2)
    a_i, a_e, s = c.intra_node_latency, c.inter_node_latency, 1e9
    # ring all-reduce inside a node: 2(n-1)/n * S/B + 2(n-1) alpha
    assert c.collective_time("all_reduce", s, 1) == pytest.approx(2 * 7 / 8 * s / 300e9 + 14 * a_i)
    # across the two nodes, 8 parallel rings, each on its GPU's 25 GB/s NIC
    assert c.collective_time("all_reduce", s, 0) == pytest.approx(s / 25e9 + 2 * a_e)
    # both axes: reduce-scatter in node, all-reduce of S/8 across nodes, all-gather in node
    rs = 7 / 8 * s / 300e9 + 7 * a_i
    expected = 2 * rs + (s / 8) / 25e9 + 2 * a_e
    assert c.collective_time("all_reduce", s, (0, 1)) == pytest.approx(expected)
    assert c.collective_time("all_gather", s, 1) == pytest.approx(7 / 8 * s / 300e9 + 7 * a_i)
    assert c.collective_time("send_recv", s, 0) == pytest.approx(s / 25e9 + a_e)
    assert c.collective_time("all_reduce", 0, 1) == 0.0


def test_hierarchy_beats_a_flat_ring_at_the_slowest_link():
    c = Cluster.preset("dgx-v100", nodes=8).with_mesh((64,))
    flat = 2 * 63 / 64 * 1e9 / c.inter_node_bandwidth
    assert c.collective_time("all_reduce", 1e9, 0) < flat / 4


def test_explicit_axis_links_are_flat():
    c = Cluster(mesh_shape=(2, 4), device="A100-80GB", axis_links=(Link(10e9, 0.0), Link(100e9, 0.0)))
    assert c.collective_time("all_gather", 4e9, 0) == pytest.approx(0.5 * 4e9 / 10e9)
    assert c.collective_time("all_gather", 8e9, (0, 1)) == pytest.approx(7 / 8 * 8e9 / 10e9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mesh_shape=(0, 8)), "positive ints"),
    (dict(mesh_shape=(2, 2, 2, 2)), "1-3"),
    (dict(mesh_shape="2x8"), "tuple"),
    (dict(mesh_shape=(8,), device="TPU-v9"), "unknown device"),
    (dict(mesh_shape=(8,), intra_node_bandwidth=-1.0), "positive"),
    (dict(mesh_shape=(2, 8), devices_per_node=8), "inter_node_bandwidth"),
    (dict(mesh_shape=(3, 4), devices_per_node=6, inter_node_bandwidth=1e9), "unevenly"),
    (dict(mesh_shape=(8,), device_memory=0), "positive"),
    (dict(mesh_shape=(2, 4), axis_links=(Link(1e9, 0.0),)), "one Link per mesh axis"),
])
def test_bad_input_says_what_to_do(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        Cluster(**kwargs)


def test_bad_queries():
    c = Cluster.preset("dgx-a100", nodes=2)
    with pytest.raises(ClusterError, match="unknown collective"):
        c.collective_time("all_scatter", 1.0, 0)
    with pytest.raises(ClusterError, match="out of range"):
        c.collective_time("all_reduce", 1.0, 2)
    with pytest.raises(ClusterError, match="distinct"):
        c.collective_time("all_reduce", 1.0, (1, 1))
    with pytest.raises(ClusterError, match="use one of"):
        Cluster.preset("dgx-z900")
    with pytest.raises(ClusterError, match="positive int"):
        Cluster.preset("dgx-a100", nodes=0)
    with pytest.raises(ClusterError, match="positive int"):
        Cluster.local(world_size=0)


def test_local_cluster(tmp_path):
    c = Cluster.local(world_size=2, cache_dir=tmp_path)   # empty cache: analytic constants
    assert c.mesh_shape == (2,) and c.calibration is None
    assert c.device_spec.kind == "cpu" and c.axis_span(0) == (2, 1)
    assert c.collective_time("all_reduce", 1e6, 0) > c.collective_time("all_reduce", 1e3, 0) > 0
    assert "analytic" in c.describe()


def test_dict_round_trip():
    for c in (Cluster.preset("dgx-h100", nodes=2, mesh_shape=(4, 4)),
              Cluster(mesh_shape=(2,), device=cpu_spec(threads=1, memory_bytes=2**30))):
        back = Cluster.from_dict(c.to_dict())
        assert back == c
        assert back.collective_time("all_reduce", 1e6, 0) == c.collective_time("all_reduce", 1e6, 0)


def test_device_spec_validation():
    with pytest.raises(ClusterError, match="efficiency"):
        cpu_spec(memory_bytes=1).replace(efficiency=(("matmul", 75.0),))
    with pytest.raises(ClusterError, match="fp32"):
        DeviceSpec(name="x", peak_flops=(("bf16", 1e12),), vector_flops=1.0, memory_bytes=1,
                   memory_bandwidth=1.0)
