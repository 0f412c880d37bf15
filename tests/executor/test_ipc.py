"""IPC wire: client-id namespacing, lane selection, HMAC verification."""

import pickle

import pytest

from executor.ipc import FRONTEND_SHIFT, MAX_FRONTENDS, Codec, ForgedMessage, lane_of, make_client_id, new_key


@pytest.mark.parametrize("fid", [0, 1, 7, 63])
@pytest.mark.parametrize("seq", [0, 1, 12345, (1 << FRONTEND_SHIFT) - 1])
def test_client_id_round_trip(fid, seq):
    cid = make_client_id(fid, seq)
    assert 0 <= cid < 1 << 63  # never touches the sign bit of an int64
    assert lane_of(cid) == fid
    assert cid & ((1 << FRONTEND_SHIFT) - 1) == seq


def test_sequence_wraps_without_changing_lane():
    assert lane_of(make_client_id(5, (1 << FRONTEND_SHIFT) + 3)) == 5


@pytest.mark.parametrize("bad", [None, -1, -(1 << 62), 1 << 63, 1 << 64])
def test_none_negative_and_out_of_range_ids_go_to_lane_zero(bad):
    assert lane_of(bad) == 0


def test_lane_beyond_the_servers_frontends_goes_to_lane_zero():
    assert lane_of(make_client_id(3, 1), num_lanes=2) == 0
    assert lane_of(make_client_id(1, 1), num_lanes=2) == 1


def test_frontend_id_range():
    with pytest.raises(ValueError):
        make_client_id(MAX_FRONTENDS, 0)
    with pytest.raises(ValueError):
        make_client_id(-1, 0)


class Boom:
    def __reduce__(self):  # would run code if ever unpickled
        raise AssertionError("a forged message was unpickled")


def test_round_trip_and_forgery_rejected_and_counted():
    codec = Codec(new_key())
    assert codec.decode(codec.encode(("add", 1, {"x": [1, 2]}))) == ("add", 1, {"x": [1, 2]})
    good = codec.encode(("abort", "r1"))
    forged = good[:-1] + bytes([good[-1] ^ 1])                 # payload flipped
    other_key = Codec(new_key()).encode(("abort", "r1"))      # signed with another key
    unsigned = b"\0" * 32 + pickle.dumps(("shutdown",))       # no valid tag at all
    for bad in (forged, other_key, unsigned, good[:20], b""):
        with pytest.raises(ForgedMessage):
            codec.decode(bad)
    assert codec.rejected == 5
    assert codec.try_decode(forged) is None and codec.rejected == 6


def test_forged_payload_is_never_unpickled():
    codec = Codec(new_key())
    evil = b"\0" * 32 + b"cposix\nsystem\n(S'false'\ntR."
    assert codec.try_decode(evil) is None


def test_key_length_enforced():
    with pytest.raises(ValueError):
        Codec(b"short")
