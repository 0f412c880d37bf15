"""The worker side of KV movement: what a role does next to the engine loop.

KV blocks live where the engine lives (a worker rank), so parking, serving and pulling them runs
there, not in the HTTP frontends. A :class:`WorkerRole` is called by the engine loop
(:class:`executor.engine_loop.EngineLoop`, in process or on rank 0) at four points: a request is
submitted, the engine asks for a KV pull, the engine produced an output, a request is aborted. The ctx role
(``ctx_worker.kv_role``) parks and serves blocks; the gen role (``gen_worker.kv_role``) pulls them.

Items a role hands to a request's stream besides engine outputs: :class:`KVHandoff` (ctx: the
answer's ``disaggregated_params``), :class:`KVTransferDone` (gen: bytes and seconds of a pull),
:class:`KVMoved` (gen: a request moved off a draining server, its lease's params),
or an exception (:class:`executor.phases.PhaseError`) that fails the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.request import EngineRequest, KVPull, RequestOutput
    from pdserve.protocol import DisaggregatedParams


@dataclass
class RankShards:
    """Every TP rank's KV cache and layout as rank 0 sees them (rank order; one entry without TP).

    Follower ranks keep their caches in shared-memory files that rank 0 maps, so rank 0's transceiver
    moves every shard: the ranks of one server share one host.
    """

    caches: list
    layouts: list


@dataclass
class KVHandoff:
    """A ``context_only`` request was parked: the params the orchestrator forwards to a gen server."""

    request_id: str
    params: "DisaggregatedParams"


@dataclass
class KVMoved:
    """gen, drain by moving KV: the request left this engine at a decode step boundary and its
    blocks are parked; ``params`` tell a target gen server how to pull them and decode on."""

    request_id: str
    params: "DisaggregatedParams"


@dataclass
class KVTransferDone:
    """A ``generation_only`` request's KV landed: ``nbytes`` bytes in ``seconds``."""

    request_id: str
    nbytes: int
    seconds: float


class WorkerOps(Protocol):
    """What the engine loop offers a role (both methods are thread-safe; each wakes a waiting loop)."""

    def post(self, fn: Callable[["LLMEngine"], None]) -> None:
        """Run ``fn(engine)`` on the engine loop thread, between steps."""

    def deliver(self, request_id: str, item: object) -> None:
        """Hand ``item`` (a KVHandoff, KVTransferDone or an exception) to the request's stream."""


class WorkerRole:
    """A role with no KV movement (colocated only); the base of the ctx and gen roles."""

    name = "colocated"
    can_move_kv = False  # parks and serves the KV of requests moved off a draining engine (gen role)

    def start(self, engine: "LLMEngine", ops: WorkerOps, shards: RankShards) -> None:
        """Called once on the loop owner before the first request; the role may start threads."""

    def on_submit(self, request: "EngineRequest", disagg: "DisaggregatedParams | None") -> None:
        """A request was submitted (engine loop thread)."""

    def on_pull(self, pull: "KVPull") -> None:
        """The engine allocated blocks for a ``generation_only`` request (engine loop thread)."""
        raise RuntimeError(f"the {self.name} role cannot pull KV (request {pull.request_id})")

    def on_output(self, out: "RequestOutput") -> None:
        """An engine output, before it is delivered (engine loop thread)."""

    def intercept_abort(self, request_id: str) -> bool:
        """Return True if the role takes over freeing this request's blocks (engine loop thread).

        Freeing blocks that another thread is still copying would ship or receive garbage, so a
        role with a transfer in flight delays the free until the transfer ends.
        """
        return False

    def release(self, ctx_request_id: str) -> bool:
        """Release a parked lease (any thread). False if there was none."""
        return False

    def await_lease(self, disagg_request_id: str, call_id: int, reply: Callable[[object], None]) -> None:
        """ctx, generation_first: call ``reply(LeaseWaitAnswer)`` once the context phase of
        ``disagg_request_id`` has an outcome (engine loop thread). A role without leases answers None."""
        reply(None)

    def cancel_lease_wait(self, disagg_request_id: str, call_id: int, abandon: bool) -> None:
        """ctx: drop wait ``call_id``; ``abandon``: also free the request's blocks (engine loop thread)."""

    def kv_source_ready(self, request_id: str, params: "DisaggregatedParams") -> None:
        """gen, generation_first: the ctx params of an admitted request; its pull may start (engine loop thread)."""

    def stats(self) -> dict:
        """Counters for /server_info and /metrics (any thread)."""
        return {}

    def stop(self) -> None:
        """Stop every thread the role started (bounded wait)."""
