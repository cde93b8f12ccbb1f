"""Cluster specs (qsync_opt.costs.cluster): the shorthand, TOML/JSON files and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_opt.core.errors import QsyncInputError, SchemaVersionError
from qsync_opt.costs.cluster import load_cluster, load_cluster_file, parse_shorthand
from qsync_opt.costs.devices import ALIASES, CATALOG
from qsync_opt.documents.schemas import ClusterSpec, DeviceGroup

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def group_tuples(spec: ClusterSpec) -> list[tuple[str, str, int, int, int | None]]:
    return [
        (g.name, g.device, g.count, g.devices_per_node, g.batch_per_device) for g in spec.groups
    ]


# ----------------------------------------------------------------------------- shorthand


def test_paper_shorthand_equals_the_example_file() -> None:
    from_text = parse_shorthand("v100x16+t4x16")
    from_file = load_cluster_file(EXAMPLES / "qsync_paper.toml")
    assert from_text == from_file
    assert from_text.content_hash() == from_file.content_hash()


def test_shorthand_defaults() -> None:
    spec = parse_shorthand("v100x16+t4x16")
    assert group_tuples(spec) == [("v100", "v100", 16, 8, None), ("t4", "t4", 16, 8, None)]
    assert spec.name == ""
    assert spec.inter_node_bandwidth_gb_per_s == 12.5
    assert spec.inter_node_latency_us == 10.0
    assert spec.intra_node_latency_us == 5.0
    assert spec.schema_name == "ClusterSpec"
    assert spec.schema_version == 1


def test_repeated_device_names_get_suffixes() -> None:
    spec = parse_shorthand("t4x2+v100x4+t4x3+t4x1")
    assert [g.name for g in spec.groups] == ["t4", "v100", "t4_2", "t4_3"]
    assert [g.device for g in spec.groups] == ["t4", "v100", "t4", "t4"]
    assert [g.count for g in spec.groups] == [2, 4, 3, 1]


@pytest.mark.parametrize(("count", "per_node", "nodes"), [(1, 1, 1), (3, 3, 1), (8, 8, 1),
                                                         (9, 8, 2), (16, 8, 2), (17, 8, 3)])
def test_devices_per_node_is_min_count_8(count: int, per_node: int, nodes: int) -> None:
    spec = parse_shorthand(f"a10x{count}")
    (g,) = spec.groups
    assert g.devices_per_node == per_node
    assert g.nodes == nodes
    assert spec.nodes == nodes


def test_devices_per_node_argument() -> None:
    spec = parse_shorthand("h100x10+t4x2", devices_per_node=4)
    assert [(g.devices_per_node, g.nodes) for g in spec.groups] == [(4, 3), (2, 1)]
    assert spec.nodes == 4


def test_batch_per_device() -> None:
    spec = parse_shorthand("a100x8@64+t4x8@32+v100x2")
    assert [g.batch_per_device for g in spec.groups] == [64, 32, None]


def test_alias_normalises_device_but_names_group_as_typed() -> None:
    spec = parse_shorthand("a100x8")
    assert group_tuples(spec) == [("a100", "a100_80gb", 8, 8, None)]
    spec = parse_shorthand("v100_sxm2x4+a100x2")
    assert [g.device for g in spec.groups] == ["v100", "a100_80gb"]


def test_shorthand_ignores_case_and_spaces() -> None:
    assert parse_shorthand(" V100x16 + T4X16 ") == parse_shorthand("v100x16+t4x16")


def test_world_size_nodes_and_batches() -> None:
    spec = parse_shorthand("a100x12@64+t4x3")
    assert spec.world_size == 15
    assert [g.nodes for g in spec.groups] == [2, 1]  # ceil(12/8), ceil(3/3)
    assert spec.nodes == 3
    with pytest.raises(ValueError, match="batch_per_device is unset"):
        spec.global_batch()
    filled = spec.with_default_batch(32)
    assert [g.batch_per_device for g in filled.groups] == [64, 32]  # set values are kept
    assert filled.global_batch() == 12 * 64 + 3 * 32  # 864
    assert spec.groups[1].batch_per_device is None  # the original is untouched (frozen)
    assert filled.with_default_batch(1) == filled


def test_group_lookup() -> None:
    spec = parse_shorthand("v100x2+t4x2")
    assert spec.group("t4").device == "t4"
    with pytest.raises(KeyError, match="no group 'a10'; groups: v100, t4"):
        spec.group("a10")


# ----------------------------------------------------------------------------- examples


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")) + sorted(EXAMPLES.glob("*.json")),
                         ids=lambda p: p.name)
def test_every_example_loads(path: Path) -> None:
    spec = load_cluster_file(path)
    assert isinstance(spec, ClusterSpec)
    assert spec.world_size >= 1
    assert load_cluster(str(path)) == spec


def test_example_contents() -> None:
    a100_t4 = load_cluster_file(EXAMPLES / "a100_t4.toml")
    assert group_tuples(a100_t4) == [("a100", "a100_80gb", 8, 8, None), ("t4", "t4", 8, 8, None)]
    assert a100_t4.inter_node_bandwidth_gb_per_s == 25.0
    assert a100_t4.name == "8 A100 80 GB + 8 T4"
    three = load_cluster_file(EXAMPLES / "h100_l4_t4.json")
    assert [g.device for g in three.groups] == ["h100", "l4", "t4"]
    assert three.world_size == 24
    assert three.nodes == 3
    assert three.inter_node_bandwidth_gb_per_s == 50.0


def test_load_cluster_dispatch() -> None:
    spec = parse_shorthand("v100x2")
    assert load_cluster(spec) is spec
    assert load_cluster("v100x2") == spec
    assert load_cluster(EXAMPLES / "qsync_paper.toml") == parse_shorthand("v100x16+t4x16")


# ----------------------------------------------------------------------------- errors


def test_unknown_device_in_shorthand() -> None:
    with pytest.raises(QsyncInputError) as exc:
        parse_shorthand("v100x2+k80x4")
    msg = str(exc.value)
    assert "groups.1.device" in msg
    assert "'k80'" in msg
    assert "t4" in msg and "h200" in msg  # known names listed


@pytest.mark.parametrize("text", ["v100", "v100x", "+t4x2", "t4x2+", "", "v100x-1", "v100x2@",
                                  "x4", "v100*4", "v100x2+t4x2@a"])
def test_malformed_shorthand(text: str) -> None:
    with pytest.raises(QsyncInputError, match=r"DEVICExCOUNT\[@BATCH\]"):
        parse_shorthand(text)


def test_zero_count_names_the_field() -> None:
    with pytest.raises(QsyncInputError, match=r"groups\.0\.count"):
        parse_shorthand("v100x0")


def test_zero_batch_names_the_field() -> None:
    with pytest.raises(QsyncInputError, match=r"groups\.1\.batch_per_device"):
        parse_shorthand("v100x2+t4x2@0")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_negative_inter_node_bandwidth(tmp_path: Path) -> None:
    p = _write(tmp_path, "neg.toml",
               'inter_node_bandwidth_gb_per_s = -1.0\n[[groups]]\nname = "a"\n'
               'device = "t4"\ncount = 2\n')
    with pytest.raises(QsyncInputError) as exc:
        load_cluster_file(p)
    msg = str(exc.value)
    assert "inter_node_bandwidth_gb_per_s" in msg
    assert str(p) in msg


def test_malformed_toml(tmp_path: Path) -> None:
    p = _write(tmp_path, "bad.toml", "[[groups]\nname = ")
    with pytest.raises(QsyncInputError, match="not valid TOML"):
        load_cluster_file(p)


def test_malformed_json(tmp_path: Path) -> None:
    p = _write(tmp_path, "bad.json", '{"groups": [')
    with pytest.raises(QsyncInputError, match="not valid JSON"):
        load_cluster_file(p)


def test_json_with_unknown_top_level_field(tmp_path: Path) -> None:
    doc = {"groups": [{"name": "a", "device": "t4", "count": 1}], "extra_field": 1}
    p = _write(tmp_path, "extra.json", json.dumps(doc))
    with pytest.raises(QsyncInputError, match="extra_field: Extra inputs are not permitted"):
        load_cluster_file(p)


def test_json_with_unknown_group_field(tmp_path: Path) -> None:
    doc = {"groups": [{"name": "a", "device": "t4", "count": 1, "bogus": 2}]}
    p = _write(tmp_path, "extra.json", json.dumps(doc))
    with pytest.raises(QsyncInputError, match=r"groups\.0\.bogus"):
        load_cluster_file(p)


def test_duplicate_group_names(tmp_path: Path) -> None:
    doc = {"groups": [{"name": "a", "device": "t4", "count": 1},
                      {"name": "a", "device": "v100", "count": 1}]}
    p = _write(tmp_path, "dup.json", json.dumps(doc))
    with pytest.raises(QsyncInputError, match="group names must be unique; repeated: a"):
        load_cluster_file(p)


def test_unknown_device_in_file(tmp_path: Path) -> None:
    p = _write(tmp_path, "dev.toml", '[[groups]]\nname = "x"\ndevice = "k80"\ncount = 1\n')
    with pytest.raises(QsyncInputError, match=r"groups\.0\.device: unknown device 'k80'"):
        load_cluster_file(p)


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.toml"
    with pytest.raises(QsyncInputError, match="file not found"):
        load_cluster_file(p)
    with pytest.raises(QsyncInputError, match="file not found"):
        load_cluster(str(p))  # a .toml name is read as a path, not a shorthand


def test_other_document_kind_is_refused(tmp_path: Path) -> None:
    doc = {"schema_name": "Plan", "groups": [{"name": "a", "device": "t4", "count": 1}]}
    p = _write(tmp_path, "plan.json", json.dumps(doc))
    with pytest.raises(SchemaVersionError, match="schema_name is 'Plan', expected 'ClusterSpec'"):
        load_cluster_file(p)


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    doc = {"schema_version": 2, "groups": [{"name": "a", "device": "t4", "count": 1}]}
    p = _write(tmp_path, "v2.json", json.dumps(doc))
    with pytest.raises(SchemaVersionError, match="schema_version 2"):
        load_cluster_file(p)


def test_json_not_an_object(tmp_path: Path) -> None:
    p = _write(tmp_path, "list.json", "[1, 2]")
    with pytest.raises(QsyncInputError, match="expected a JSON object holding a ClusterSpec"):
        load_cluster_file(p)


def test_file_round_trip(tmp_path: Path) -> None:
    spec = parse_shorthand("a100x8@64+t4x3")
    p = _write(tmp_path, "c.json", spec.model_dump_json())
    assert load_cluster_file(p) == spec


# ----------------------------------------------------------------------------- property

DEVICE_WORDS = sorted([*CATALOG, *ALIASES])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(DEVICE_WORDS),
            st.integers(min_value=1, max_value=64),
            st.none() | st.integers(min_value=1, max_value=4096),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_shorthand_round_trip(groups: list[tuple[str, int, int | None]]) -> None:
    text = "+".join(f"{d}x{c}" + (f"@{b}" if b is not None else "") for d, c, b in groups)
    spec = parse_shorthand(text)
    assert len(spec.groups) == len(groups)
    seen: dict[str, int] = {}
    for g, (word, count, batch) in zip(spec.groups, groups, strict=True):
        seen[word] = seen.get(word, 0) + 1
        assert g.device == ALIASES.get(word, word)
        assert g.count == count
        assert g.batch_per_device == batch
        assert g.devices_per_node == min(count, 8)
        assert g.name == (word if seen[word] == 1 else f"{word}_{seen[word]}")
    assert spec.world_size == sum(c for _, c, _ in groups)
    assert isinstance(spec.groups[0], DeviceGroup)
