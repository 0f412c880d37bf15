"""Block runs: a pull moves as few contiguous segments as both sides' block ids allow."""

import pytest

from kv_transfer.runs import Segment, from_runs, plan_segments, to_runs


def test_runs_round_trip():
    ids = [5, 6, 7, 2, 9, 10]
    assert to_runs(ids) == [[5, 3], [2, 1], [9, 2]]
    assert from_runs(to_runs(ids)) == ids


def test_contiguous_on_both_sides_is_one_segment():
    assert plan_segments([10, 11, 12, 13], [0, 1, 2, 3]) == [Segment(10, 0, 4)]


def test_segment_ends_where_either_side_breaks():
    assert plan_segments([1, 2, 3, 7, 8], [4, 5, 9, 10, 11]) == [
        Segment(1, 4, 2), Segment(3, 9, 1), Segment(7, 10, 2)]


def test_bad_input():
    with pytest.raises(ValueError):
        plan_segments([1], [1, 2])
    with pytest.raises(ValueError, match="bad block run"):
        from_runs([[3, 0]])
