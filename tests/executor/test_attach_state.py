"""Attached-frontend state: attach info travels in one env var, popped on read."""

import os

import pytest

from executor.proxy import ATTACH_ENV, AttachInfo


def info() -> AttachInfo:
    return AttachInfo(ipc_dir="/tmp/x", key_hex="00" * 32, ingress_addr="ipc:///tmp/x/ingress",
                      lane_addrs=[f"ipc:///tmp/x/lane{i}" for i in range(3)],
                      ranks=[{"rank": 0, "pid": 1, "start_time": 2}], worker_info={"max_model_len": 8})


def test_attach_info_is_popped_from_the_environment(monkeypatch):
    monkeypatch.setenv(ATTACH_ENV, info().to_env(2))
    got = AttachInfo.pop_from_env()
    assert ATTACH_ENV not in os.environ
    assert got.frontend_id == 2 and got.lane_addrs[2].endswith("lane2")
    assert got.rank_processes()[0].pid == 1
    with pytest.raises(KeyError):
        AttachInfo.pop_from_env()


def test_attached_frontend_cannot_shut_the_engine_down():
    from executor.lattice_client import LatticeClient

    client = LatticeClient.__new__(LatticeClient)  # no sockets needed for this check
    client.frontend_id = 1
    with pytest.raises(RuntimeError, match="only frontend 0"):
        client.send_engine_shutdown()
