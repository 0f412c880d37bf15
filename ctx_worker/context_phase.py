"""The ``context_only`` phase: prefill, sample the first token, park the KV blocks under a lease.

The answer's ``disaggregated_params`` tell the orchestrator (and through it the gen server) where
the blocks are (``kv_endpoint``), how they are laid out (``kv_layout``), how many to pull
(``kv_block_count`` = ceil(prompt tokens / block_size)) and until when they are kept
(``lease_deadline``, unix seconds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from engine.request import EngineRequest, KVPull, RequestOutput
from executor.engine_client import EngineClient
from executor.http_server import ServerState
from executor.phases import PhaseAnswer, PhaseError
from kv_transfer.layout import KVLayout, blocks_for_tokens
from kv_transfer.lease import LeaseTable
from kv_transfer.tcp_backend import TcpKVServer
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)


class ContextPhase:
    """Runs ``context_only`` requests and parks their blocks in ``leases``."""

    def __init__(self, client: EngineClient, leases: LeaseTable, kv_endpoint: str, layout: KVLayout,
                 lease_ms: int) -> None:
        self.client, self.leases, self.kv_endpoint = client, leases, kv_endpoint
        self.layout, self.lease_s = layout, lease_ms / 1000.0

    async def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                       answer: PhaseAnswer) -> AsyncIterator[RequestOutput]:
        async for item in self.client.generate(request):
            if isinstance(item, KVPull):
                raise PhaseError("engine asked for a KV pull on a context_only request", 500, "internal")
            if item.finished and item.finish_reason is None:
                answer.disaggregated_params = self._park(request, item, params)
            yield item

    def _park(self, request: EngineRequest, out: RequestOutput, params: DisaggregatedParams | None) -> DisaggregatedParams:
        if not out.parked_block_ids:
            raise PhaseError("engine handed the request off without parked KV blocks", 500, "internal")
        num_tokens = len(request.prompt_token_ids)
        self.leases.park(request.request_id, out.parked_block_ids, num_tokens, self.lease_s)
        return DisaggregatedParams(
            request_type="context_only",
            disagg_request_id=params.disagg_request_id if params else None,
            ctx_request_id=request.request_id,
            first_gen_tokens=list(out.new_token_ids),
            prompt_token_ids=list(request.prompt_token_ids),
            kv_endpoint=self.kv_endpoint,
            kv_layout=self.layout,
            kv_block_count=blocks_for_tokens(num_tokens, self.layout.block_size),
            lease_deadline=time.time() + self.lease_s,
        )


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ctx_request_id: str


def release_router(leases: LeaseTable) -> APIRouter:
    """``POST /disagg/release``: the orchestrator gives up a parked request (e.g. client left)."""
    router = APIRouter()

    @router.post("/disagg/release")
    async def release(body: ReleaseBody) -> dict:
        return {"released": leases.release(body.ctx_request_id)}

    return router


def setup_ctx_role(state: ServerState, client: EngineClient) -> None:
    """Add the lease table, the KV transceiver, the ``context_only`` handler and the release route."""
    cfg, metrics = state.config, state.metrics

    def on_free(ctx_request_id: str, reason: str) -> None:
        client.release_parked(ctx_request_id)
        metrics.kv_leases.labels(reason=reason).inc()

    def on_sent(nbytes: int, seconds: float) -> None:
        metrics.kv_bytes.labels(direction="sent").inc(nbytes)
        metrics.kv_seconds.labels(direction="sent").observe(seconds)

    leases = LeaseTable(on_free)
    server = TcpKVServer(client.kv_cache, state.kv_layout, leases, cfg.host, cfg.kv_port,
                         timeout_s=cfg.kv_transfer.timeout_ms / 1000.0, on_sent=on_sent)
    leases.start()
    server.start()
    state.on_shutdown.extend([leases.stop, server.stop])  # run in reverse: server first, then leases
    state.handlers["context_only"] = ContextPhase(client, leases, server.endpoint, state.kv_layout,
                                                  cfg.kv_transfer.lease_ms)
    state.routers.append(release_router(leases))

    def info() -> dict:
        metrics.kv_parked.set(len(leases))
        return {"kv_endpoint": server.endpoint, "parked_leases": len(leases),
                "leases_expired": leases.expired_total, "leases_released": leases.released_total}

    state.extra_info = info
