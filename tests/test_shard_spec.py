"""ShardSpec: a complete description of a split, from which every tp's ranges follow; checkpoints read only it."""

from __future__ import annotations

import pytest

from optimum_parallel.checkpoint.metadata import model_file
from optimum_parallel.checkpoint.sharding import entries_from_specs, target_layout
from optimum_parallel.comm.regions import shard_range
from optimum_parallel.tensor_parallel.spec import ReplicatedSegment, ShardSpec, check_heads


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


def test_round_trip_and_replicated():
    spec = ShardSpec.packed((48, 8), 0, [32, 16], [4, None])
    assert ShardSpec.from_dict(spec.to_dict()) == spec
    assert ShardSpec((5,)).local(1, 2).dim is None and not ShardSpec((5,)).is_split


def _rank_spec(spec: ShardSpec, rank: int, tp: int) -> dict:
    layout = spec.local(rank, tp)
    return {
        "dtype": "F32",
        "global_shape": list(spec.global_shape),
        "dim": spec.dim,
        "ranges": [list(r) for r in layout.ranges],
        "replicas": layout.replicas,
        "parts": [list(p) for p in spec.parts],
        "kind": "param",
        "param": None,
        "like_param": False,
    }


def test_checkpoint_entries_carry_the_spec_and_reshard_from_it_alone():
    """Saved at tp=2, the index holds the head counts; tp=4 then replicates kv heads instead of cutting one."""
    qkv = ShardSpec.packed((64, 32), 0, [32, 16, 16], [4, 2, 2])
    specs = {(0, t): {"qkv.weight": _rank_spec(qkv, t, 2)} for t in range(2)}
    (entry,) = entries_from_specs(specs, 2, model_file).values()
    assert entry.split == "parts" and entry.parts == [[32, 4], [16, 2], [16, 2]]
    assert [target_layout("qkv.weight", entry, t, 4) for t in range(4)] == [qkv.local(t, 4) for t in range(4)]
