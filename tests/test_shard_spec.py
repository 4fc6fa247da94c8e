"""ShardSpec: a complete description of a split, from which every tp's ranges follow; checkpoints read only it."""

from __future__ import annotations

import json

import pytest

from optimum_parallel.checkpoint.metadata import model_file
from optimum_parallel.checkpoint.sharding import entries_from_specs, target_layout
from optimum_parallel.tensor_parallel.spec import (
    ReplicatedSegment,
    ShardLayout,
    ShardSpec,
    check_heads,
    shard_range,
    shard_sizes,
)


def test_rows_split_unevenly_like_torch_tensor_split():
    spec = ShardSpec.split((10, 4), 0)
    assert [spec.local(r, 3).ranges for r in range(3)] == [((0, 4),), ((4, 7),), ((7, 10),)]
    assert [spec.local(r, 3).ranges[0] for r in range(3)] == [shard_range(10, r, 3) for r in range(3)]
    assert spec.local(1, 3).local_shape == (3, 4)


def test_whole_heads_and_replicated_heads():
    kv = ShardSpec.split((2 * 8, 32), 0, heads=2)  # 2 kv heads of 8 rows
    assert [kv.local(r, 2).ranges for r in range(2)] == [((0, 8),), ((8, 16),)]
    four = [kv.local(r, 4) for r in range(4)]  # tp=4 > 2 heads: each head on 2 ranks
    assert [layout.ranges for layout in four] == [((0, 8),), ((0, 8),), ((8, 16),), ((8, 16),)]
    assert {layout.replicas for layout in four} == {2}


def test_packed_parts_split_each_on_their_own():
    qkv = ShardSpec.packed((4 * 8 + 2 * 8 + 2 * 8, 32), 0, [32, 16, 16], [4, 2, 2])
    layout = qkv.local(3, 4)
    assert layout.ranges == ((24, 32), (40, 48), (56, 64))  # q head 3, kv head 1 (replicated), v head 1
    assert layout.replicas == 1  # q is not replicated, k and v are: the segments say which rows
    assert qkv.replicated_segments(3, 4) == [ReplicatedSegment(8, 8, 2), ReplicatedSegment(16, 8, 2)]
    assert layout.spec is qkv


def test_bad_splits_name_the_heads_and_the_rule():
    with pytest.raises(ValueError, match="3 heads cannot be split over tensor-parallel size 2; tp must divide 3"):
        ShardSpec.split((24, 4), 0, heads=3).check(2)
    with pytest.raises(ValueError, match="do not add up"):
        ShardSpec.packed((10, 4), 0, [4, 4], [None, None])
    with pytest.raises(ValueError, match="or be a multiple of it"):
        check_heads(3, 4)


QKV = ShardSpec.packed((64, 32), 0, [32, 16, 16], [4, 2, 2])
SPECS = {  # every kind of split, with the tp sizes it is cut at
    "plain rows, uneven": (ShardSpec.split((10, 4), 0), (1, 3, 4)),
    "whole heads": (ShardSpec.split((4 * 8, 32), 0, heads=4), (1, 2, 4)),
    "columns (row-parallel)": (ShardSpec.split((32, 64), 1), (2,)),
    "packed q|k|v, 4 q and 2 kv heads": (QKV, (1, 2)),
    "packed q|k|v, kv heads replicated at tp > kv heads": (QKV, (4,)),
    "packed gate|up in rows": (ShardSpec.packed((48, 8), 0, [32, 16], [4, None]), (2,)),
    "not split": (ShardSpec((5, 3)), (1, 2)),
}


@pytest.mark.parametrize("name", SPECS)
def test_spec_and_layout_json_round_trip(name):
    spec, tps = SPECS[name]
    data = spec.to_json()
    assert json.loads(json.dumps(data)) == data  # JSON-ready as it is
    assert ShardSpec.from_json(data) == spec
    for tp in tps:
        for rank in range(tp):
            layout = spec.local(rank, tp)
            data = json.loads(json.dumps(layout.to_json()))
            back = ShardLayout.from_json(data)
            assert back == layout and back.spec == spec and back.to_json() == data
            assert ShardSpec.from_json(data) == spec  # a layout's JSON holds its spec's


def test_json_is_the_checkpoint_index_format():
    """The spec's JSON is the index entry's global_shape / dim / parts; a layout adds a shard's ranges / replicas."""
    qkv = ShardSpec.packed((64, 32), 0, [32, 16, 16], [4, 2, None])
    assert qkv.to_json() == {"global_shape": [64, 32], "dim": 0, "parts": [[32, 4], [16, 2], [16, None]]}
    assert ShardSpec((5,)).to_json() == {"global_shape": [5], "dim": None, "parts": []}
    assert qkv.local(3, 4).to_json() == {
        "global_shape": [64, 32],
        "dim": 0,
        "parts": [[32, 4], [16, 2], [16, None]],
        "ranges": [[24, 32], [40, 48], [60, 64]],
        "replicas": 1,
    }
    bare = ShardLayout((10, 4), 0, ((0, 5),))  # a layout without a spec (an older "custom" checkpoint entry)
    assert "parts" not in bare.to_json() and ShardLayout.from_json(bare.to_json()).spec is None


def test_round_trip_and_replicated():
    assert ShardSpec((5,)).local(1, 2).dim is None and not ShardSpec((5,)).is_split
    assert shard_sizes(10, 4) == [3, 3, 2, 2] and shard_range(10, 2, 4) == (6, 8)


def _rank_spec(spec: ShardSpec, rank: int, tp: int) -> dict:
    return {"dtype": "F32", **spec.local(rank, tp).to_json(), "kind": "param", "param": None, "like_param": False}


def test_checkpoint_entries_carry_the_spec_and_reshard_from_it_alone():
    """Saved at tp=2, the index holds the head counts; tp=4 then replicates kv heads instead of cutting one."""
    qkv = ShardSpec.packed((64, 32), 0, [32, 16, 16], [4, 2, 2])
    specs = {(0, t): {"qkv.weight": _rank_spec(qkv, t, 2)} for t in range(2)}
    (entry,) = entries_from_specs(specs, 2, model_file).values()
    assert entry.split == "parts" and entry.parts == [[32, 4], [16, 2], [16, 2]]
    assert [target_layout("qkv.weight", entry, t, 4) for t in range(4)] == [qkv.local(t, 4) for t in range(4)]
