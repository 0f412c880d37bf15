"""The executor's IPC messages: every message between a frontend and the engine loop, defined once.

Frontend → engine loop (:data:`Command`): :class:`AddRequest`, :class:`AbortRequest`,
:class:`ReleaseLease`, :class:`StatsQuery`, :class:`ResetPrefixCache`, :class:`KVSnapshotQuery`,
:class:`Drain`, :class:`Shutdown`, and for ``generation_first`` :class:`AwaitLease`,
:class:`CancelLeaseWait` (ctx) and :class:`KVSourceReady` (gen).
Engine loop → frontend (:data:`Event`): :class:`Output`, :class:`Reply`, :class:`StatsSnapshot`,
:class:`KVEvents`, :class:`EngineDead`.
Worker rank → proxy at start-up (:data:`Handshake`): :class:`RankHello`, :class:`RankFailed`,
:class:`RankReady`, and the proxy's :class:`Ack`.

In the lattice they travel as HMAC-signed pickles (:class:`executor.ipc.Codec`): a command is one
zmq message; events are fused, up to ``executor.ipc.MAX_BATCH`` per zmq message (a list). The
in-process executor passes the same objects through a queue, unpickled. Ids: ``client_id`` and
``call_id`` are uint64 client ids (:func:`executor.ipc.make_client_id`), whose bits 57..62 name
the frontend whose lane gets the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from engine.request import EngineRequest
    from pdserve.kv_events import KVEventBatch
    from pdserve.protocol import DisaggregatedParams


# ---- frontend → engine loop ----------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """Submit ``request``; its items go to the lane of ``client_id``. ``disagg`` routes the phase."""

    client_id: int
    request: "EngineRequest"
    disagg: "DisaggregatedParams | None" = None


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (a no-op when the id is unknown or already finished)."""

    request_id: str


@dataclass(frozen=True)
class ReleaseLease:
    """Release a parked KV lease; answered by a :class:`Reply` (bool) on ``call_id``'s lane."""

    call_id: int
    ctx_request_id: str


@dataclass(frozen=True)
class StatsQuery:
    """Ask for a stats snapshot now; answered by a :class:`Reply` (dict) on ``call_id``'s lane."""

    call_id: int


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every prefix-cache block hash; answered by a :class:`Reply` (int: unreferenced cached
    blocks freed) on ``call_id``'s lane."""

    call_id: int


@dataclass(frozen=True)
class KVSnapshotQuery:
    """Ask for every cached block hash; answered by a :class:`Reply` (a
    :class:`pdserve.kv_events.KVSnapshot`) on ``call_id``'s lane, after the KV event batches it covers."""

    call_id: int


@dataclass(frozen=True)
class AwaitLease:
    """ctx, generation_first: answer a :class:`Reply` (a ``pdserve.kv_wait.LeaseWaitAnswer``) on
    ``call_id``'s lane once the context phase of ``disagg_request_id`` parked, finished or failed
    (at once if it already did). The frontend bounds the wait and then sends :class:`CancelLeaseWait`."""

    call_id: int
    disagg_request_id: str


@dataclass(frozen=True)
class CancelLeaseWait:
    """ctx: forget the wait ``call_id``; ``abandon``: the waiter gave up for good (its time ran
    out), so the context request of ``disagg_request_id`` is aborted or its lease released."""

    call_id: int
    disagg_request_id: str
    abandon: bool = False


@dataclass(frozen=True)
class KVSourceReady:
    """gen, generation_first: the ctx server parked the KV of ``request_id`` (an admitted
    ``generation_only`` request); ``params`` are the ctx answer's, the pull may start."""

    request_id: str
    params: "DisaggregatedParams"


@dataclass(frozen=True)
class Drain:
    """Stop admitting new requests (serving → draining); in-flight ones finish, or with ``move_kv``
    every movable request is moved off at its next decode step boundary (its KV parked under a
    lease for another gen server; :meth:`engine.llm_engine.LLMEngine.move_out`)."""

    move_kv: bool = False


@dataclass(frozen=True)
class Shutdown:
    """Stop the engine loop after this iteration (sent by frontend 0 only, or the in-process owner)."""

    reason: str = "shutdown requested"


Command = Union[AddRequest, AbortRequest, ReleaseLease, StatsQuery, ResetPrefixCache, KVSnapshotQuery, AwaitLease,
                CancelLeaseWait, KVSourceReady, Drain, Shutdown]
COMMANDS = (AddRequest, AbortRequest, ReleaseLease, StatsQuery, ResetPrefixCache, KVSnapshotQuery, AwaitLease,
            CancelLeaseWait, KVSourceReady, Drain, Shutdown)  # for isinstance checks


# ---- engine loop → frontend ----------------------------------------------------------------------
@dataclass(frozen=True)
class Output:
    """One item of a request's stream: a ``RequestOutput``, a role item (``KVHandoff``,
    ``KVTransferDone``) or an exception that ends the stream."""

    request_id: str
    item: object


@dataclass(frozen=True)
class Reply:
    """The answer to a :class:`ReleaseLease`, :class:`StatsQuery`, :class:`ResetPrefixCache` or
    :class:`AwaitLease` (which may come many steps later)."""

    call_id: int
    value: object


@dataclass(frozen=True)
class StatsSnapshot:
    """Engine, loop and role counters, pushed to every lane when they change (at most every 0.25 s)."""

    stats: dict


@dataclass(frozen=True)
class KVEvents:
    """One engine step's prefix-cache events, pushed to every lane (each frontend serves ``GET /kv_events``)."""

    batch: "KVEventBatch"


@dataclass(frozen=True)
class EngineDead:
    """The engine loop failed: the engine is dead for good."""

    reason: str


Event = Union[Output, Reply, StatsSnapshot, KVEvents, EngineDead]


# ---- start-up handshake (worker rank → proxy, DEALER → ROUTER) ------------------------------------
@dataclass(frozen=True)
class RankHello:
    """Sent as soon as MPI is up, so the proxy knows the pid even of a rank that fails later."""

    rank: int
    pid: int
    start_time: int


@dataclass(frozen=True)
class RankFailed:
    """The rank could not load its shard or start its role; it exits after this."""

    rank: int
    cause: str


@dataclass(frozen=True)
class RankReady:
    """The rank is loaded; rank 0's ``info`` names max_model_len, vocab, eos ids and KV layouts."""

    rank: int
    info: dict


@dataclass(frozen=True)
class Ack:
    """Proxy → rank: the death callbacks are attached after this; the rank may serve."""
