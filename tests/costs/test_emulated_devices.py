"""Derived CPU devices (``cpu/F[:MEM][~CARD]``): a hybrid cluster emulated on one CPU box."""

from __future__ import annotations

import pytest

from qsync_opt import trace
from qsync_opt.core.errors import QsyncInputError
from qsync_opt.core.precision import DType, Precision
from qsync_opt.costs.cluster import SHORTHAND_HELP, load_cluster, parse_shorthand
from qsync_opt.costs.devices import (
    CATALOG,
    base_device,
    canonical_name,
    get_device,
    is_derived,
    known_device_names,
)
from qsync_opt.costs.roofline import estimate, group_summary
from qsync_opt.documents.schemas import ClusterSpec, DeviceGroup, DeviceSpec, Plan
from qsync_opt.problem.plan import make_plan
from qsync_opt.replayer import Replayer

GiB = 1024**3
MiB = 1024**2


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("cpu/2", "cpu/2"),
        ("CPU/2.0", "cpu/2"),
        (" cpu/2.50 ", "cpu/2.5"),
        ("cpu/1", "cpu/1"),
        ("cpu/3:4g", "cpu/3:4g"),
        ("cpu/3:512M", "cpu/3:512m"),
        ("cpu/2~a100", "cpu/2~a100_80gb"),  # the card's alias resolves
        ("cpu/2:1.5g~t4", "cpu/2:1.5g~t4"),
    ],
)
def test_canonical_derived_names(given: str, canonical: str) -> None:
    assert canonical_name(given) == canonical
    assert is_derived(given)
    assert base_device(given) == "cpu"


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("cpu/0.5", "factor must be >= 1"),
        ("cpu/0", "factor must be >= 1"),
        ("cpu/", "cpu/F[:MEM][~CARD]"),
        ("cpu/two", "cpu/F[:MEM][~CARD]"),
        ("cpu/2:4t", "cpu/F[:MEM][~CARD]"),
        ("cpu/2:0g", "memory cap must be > 0"),
        ("cpu/2~k80", "not a catalog card"),
        ("cpu/2~cpu", "not a catalog card"),
    ],
)
def test_bad_derived_names_are_one_line(bad: str, needle: str) -> None:
    with pytest.raises(QsyncInputError) as exc:
        get_device(bad)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_catalog_listing_is_unchanged() -> None:
    assert "cpu/2" not in known_device_names()
    assert not is_derived("cpu") and base_device("a100") == "a100_80gb"


def test_derived_cpu_divides_the_measured_rates() -> None:
    cpu = get_device("cpu")
    d = get_device("cpu/2")
    assert isinstance(d, DeviceSpec)
    assert d.name == "cpu/2" and d.slowdown == 2.0 and cpu.slowdown == 1.0
    assert d.measured and d.compute_capability is None
    assert d.source.startswith("emulation: derived from the measured cpu")
    assert "2x" in d.source
    assert d.peak_tflops == {k: v / 2 for k, v in cpu.peak_tflops.items()}
    assert d.memory_bandwidth_gb_per_s == pytest.approx(cpu.memory_bandwidth_gb_per_s / 2)
    # Communication is not slowed: the emulation stretches compute only.
    assert d.intra_node_bandwidth_gb_per_s == cpu.intra_node_bandwidth_gb_per_s
    assert d.memory_bytes == cpu.memory_bytes and d.usable_memory_bytes == cpu.usable_memory_bytes
    assert d.precisions == cpu.precisions
    assert get_device("CPU/2.0") is d  # cached per canonical name
    # Every real device says 1.
    assert all(spec.slowdown == 1.0 for spec in CATALOG.values())


def test_memory_cap_and_card_menu() -> None:
    cpu = get_device("cpu")
    d = get_device("cpu/3:512m~t4")
    assert d.slowdown == 3.0
    assert d.memory_bytes == 512 * MiB
    assert d.usable_memory_bytes == min(cpu.usable_memory_bytes, 512 * MiB)
    assert d.precisions == [p for p in cpu.precisions if CATALOG["t4"].supports(p)]
    assert Precision.bf16 not in d.precisions  # a T4 has no bf16
    assert DType.bf16 not in d.peak_tflops
    assert d.peak_tflops[DType.fp16] == pytest.approx(cpu.peak_tflops[DType.fp16] / 3)
    assert "t4" in d.source and "512 MiB" in d.source
    v = get_device("cpu/2~v100")
    assert v.precisions == [Precision.fp32, Precision.fp16]  # SM70 menu, both on this CPU
    a = get_device("cpu/2~a100")
    assert Precision.tf32 not in a.precisions  # this CPU has no tf32 mode
    assert Precision.bf16 in a.precisions


def test_shorthand_names_the_groups() -> None:
    c = parse_shorthand("cpux1+cpu/2x1")
    assert [(g.name, g.device, g.count) for g in c.groups] == [("cpu", "cpu", 1),
                                                               ("cpu_2", "cpu/2", 1)]
    c = parse_shorthand("cpu/2.5:4g~t4x2@16+cpux1+cpu/3x1")
    assert [(g.name, g.device, g.count, g.batch_per_device) for g in c.groups] == [
        ("cpu", "cpu/2.5:4g~t4", 2, 16), ("cpu_2", "cpu", 1, None), ("cpu_3", "cpu/3", 1, None)]
    # A card alias that contains an 'x' still parses.
    assert parse_shorthand("cpu/2~v100_sxm2x1").groups[0].device == "cpu/2~v100"
    assert load_cluster("cpux1+cpu/2x1") == parse_shorthand("cpux1+cpu/2x1")
    assert "cpu/F" in SHORTHAND_HELP


@pytest.mark.parametrize(("bad", "needle"), [("cpu/0.5x1", "factor"), ("cpu/2~k80x1", "k80"),
                                            ("cpu/x1", "DEVICExCOUNT")])
def test_bad_shorthand(bad: str, needle: str) -> None:
    with pytest.raises(QsyncInputError) as exc:
        parse_shorthand(bad)
    assert needle in str(exc.value)


def test_device_group_and_cluster_file_accept_derived_devices(tmp_path) -> None:
    g = DeviceGroup(name="slow", device="CPU/2.0", count=1)
    assert g.device == "cpu/2"
    c = ClusterSpec(groups=[DeviceGroup(name="fast", device="cpu", count=1), g])
    path = tmp_path / "c.json"
    c.save(path)
    assert load_cluster(path) == c


@pytest.fixture(scope="module")
def digits():
    return trace("digits_cnn", batch=8)


def test_costs_and_replayer_see_the_slowdown(digits, tmp_path) -> None:
    cluster = parse_shorthand("cpux1@8+cpu/2x1@8")
    costs = estimate(digits, cluster)
    devices = {e.device for e in costs.entries}
    assert devices == {"cpu", "cpu/2"}
    fast = {(e.op, e.precision): e for e in costs.entries if e.device == "cpu"}
    slow = {(e.op, e.precision): e for e in costs.entries if e.device == "cpu/2"}
    assert fast.keys() == slow.keys()
    assert sum(e.fwd_ms + e.bwd_ms for e in slow.values()) > \
        1.5 * sum(e.fwd_ms + e.bwd_ms for e in fast.values())
    rows = {r["group"]: r for r in group_summary(digits, cluster, costs)}
    assert rows["cpu_2"]["compute_fp32_ms"] > 1.5 * rows["cpu"]["compute_fp32_ms"]

    rep = Replayer(digits, cluster, costs)
    tl = rep.simulate(rep.uniform("highest"))
    assert tl.straggler == "cpu_2"
    # A plan over the derived cluster round-trips through its file.
    plan = make_plan(digits, cluster, rep.uniform("highest"))
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert [g.device for g in again.cluster.groups] == ["cpu", "cpu/2"]


def test_card_menu_restricts_the_replayer_menu(digits) -> None:
    cluster = parse_shorthand("cpux1@8+cpu/2~t4x1@8")
    rep = Replayer(digits, cluster, estimate(digits, cluster))
    menus = {g.name: set(g.menu) for g in rep.groups}
    assert Precision.bf16 in menus["cpu"]
    assert Precision.bf16 not in menus["cpu_2"]
