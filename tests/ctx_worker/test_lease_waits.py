"""generation_first on the ctx side: waits meet outcomes in either order; an abandoned wait frees the request."""

from __future__ import annotations

import pytest

from ctx_worker.kv_role import CtxKVRole
from ctx_worker.lease_waits import WAITER_GRACE_S, LeaseWaits
from engine.errors import RequestValidationError
from engine.request import EngineRequest, Phase, RequestOutput
from engine.sampling_params import SamplingParams
from executor.phases import PhaseError
from kv_transfer.layout import KVLayout
from pdserve.config import KVTransferSettings
from pdserve.kv_wait import MAX_WAIT_MS, LeaseWaitAnswer
from pdserve.protocol import DisaggregatedParams

PARKED = LeaseWaitAnswer(state="parked")
FINISHED = LeaseWaitAnswer(state="finished")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_wait_that_comes_first_is_answered_by_the_outcome():
    waits, got = LeaseWaits(keep_s=30), []
    waits.wait("d1", 1, got.append)
    waits.wait("d1", 2, got.append)  # two waiters (a retried gen request) both hear it
    assert got == [] and waits.num_waiting() == 2
    waits.settle("d1", PARKED)
    assert got == [PARKED, PARKED] and waits.num_waiting() == 0 and waits.answered == 2


def test_an_outcome_that_comes_first_answers_a_later_wait_at_once_until_forgotten():
    waits, got = LeaseWaits(keep_s=30), []
    waits.settle("d1", PARKED)
    waits.wait("d1", 1, got.append)
    assert got == [PARKED]
    waits.forget("d1")  # its lease was freed: the next wait must not be sent to it
    waits.wait("d1", 2, got.append)
    assert got == [PARKED] and waits.num_waiting() == 1


def test_outcomes_expire_and_cancelled_waits_hear_nothing():
    clock, got = Clock(), []
    waits = LeaseWaits(keep_s=5, clock=clock)
    waits.settle("old", FINISHED)
    clock.t += 6
    waits.wait("old", 1, got.append)  # expired: waits like any other
    assert got == [] and waits.num_waiting() == 1
    waits.cancel("old", 1)
    waits.settle("old", PARKED)
    assert got == [] and waits.num_waiting() == 0


def test_waiters_nobody_cancelled_are_dropped_after_the_longest_wait():
    clock, got = Clock(), []
    waits = LeaseWaits(keep_s=5, clock=clock)
    waits.wait("lost", 1, got.append)
    clock.t += MAX_WAIT_MS / 1000 + WAITER_GRACE_S + 1
    waits.settle("other", PARKED)  # any call prunes
    assert waits.num_waiting() == 0


def test_bind_maps_a_disagg_id_to_its_request_until_unbound():
    waits = LeaseWaits(keep_s=5)
    waits.bind("d1", "ctx-1")
    assert waits.request_of("d1") == "ctx-1" and waits.disagg_of("ctx-1") == "d1"
    waits.unbind("ctx-1")
    assert waits.request_of("d1") is None and waits.disagg_of("ctx-1") is None


# ---- the ctx worker role's hooks (no transceiver started) ------------------------------------
class Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


class Ops:
    def __init__(self) -> None:
        self.delivered: list[tuple[str, object]] = []

    def post(self, fn) -> None:
        raise AssertionError("not expected here")

    def deliver(self, rid: str, item: object) -> None:
        self.delivered.append((rid, item))


def role() -> CtxKVRole:
    layout = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
    r = CtxKVRole(KVTransferSettings(), layout, "127.0.0.1", 0)
    r.engine, r.ops = Engine(), Ops()  # start() would also start the lease table and KV servers
    return r


def submit(r: CtxKVRole, rid: str, disagg_id: str) -> None:
    req = EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), phase=Phase.CONTEXT_ONLY)
    r.on_submit(req, DisaggregatedParams(request_type="context_only", disagg_request_id=disagg_id))


def test_an_abandoned_wait_fails_and_aborts_the_context_request():
    r, got = role(), []
    submit(r, "ctx-1", "d1")
    r.await_lease("d1", 7, got.append)
    r.cancel_lease_wait("d1", 7, abandon=False)  # the gen server hung up: the lease may go elsewhere
    assert r.engine.aborted == [] and r.ops.delivered == []
    r.await_lease("d1", 8, got.append)
    r.cancel_lease_wait("d1", 8, abandon=True)   # its ctx_wait_ms ran out
    assert r.engine.aborted == ["ctx-1"]
    (rid, err), = r.ops.delivered
    assert rid == "ctx-1" and isinstance(err, PhaseError) and err.status == 504 and err.kind == "ctx_wait_timeout"
    assert got == []  # the waiter had already gone


def test_a_context_request_arriving_after_its_wait_was_abandoned_is_refused():
    r = role()
    r.await_lease("d2", 1, lambda _: None)
    r.cancel_lease_wait("d2", 1, abandon=True)
    with pytest.raises(RequestValidationError, match="stopped waiting"):
        submit(r, "ctx-2", "d2")


def test_a_first_token_that_ends_the_request_settles_finished_and_an_abort_failed():
    r, got = role(), []
    for rid, did in (("ctx-3", "d3"), ("ctx-4", "d4")):
        submit(r, rid, did)
        r.await_lease(did, 1, got.append)
    r.on_output(RequestOutput("ctx-3", [9], "x", True, "length", 3, 1))
    r.on_output(RequestOutput("ctx-4", [], "", True, "abort", 3, 0))
    assert [a.state for a in got] == ["finished", "failed"]
    assert r.waits.request_of("d3") is None and r.waits.request_of("d4") is None
