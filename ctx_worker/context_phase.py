"""Frontend side of the context role: the ``context_only`` handler and ``POST /disagg/release``.

The worker side (``ctx_worker.kv_role``) parks the blocks and hands back the answer's
``disaggregated_params``: where the blocks are (``kv_endpoint``), how they are laid out
(``kv_layout``), how many to pull (``kv_block_count`` = ceil(prompt tokens / block_size)) and until
when they are kept (``lease_deadline``, unix seconds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from engine.request import EngineRequest, RequestOutput
from executor.engine_client import EngineClient
from executor.http_server import ServerState
from executor.kv_role import KVHandoff
from executor.phases import PhaseAnswer
from pdserve.protocol import DisaggregatedParams


class ContextPhase:
    """Runs ``context_only`` requests; the handoff params become the answer's ``disaggregated_params``."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                       answer: PhaseAnswer) -> AsyncIterator[RequestOutput]:
        async for item in self.client.generate(request, params):
            if isinstance(item, KVHandoff):
                answer.disaggregated_params = item.params
                continue
            yield item


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ctx_request_id: str


def release_router(client: EngineClient) -> APIRouter:
    """``POST /disagg/release``: the orchestrator gives up a parked request (e.g. its client left)."""
    router = APIRouter()

    @router.post("/disagg/release")
    async def release(body: ReleaseBody) -> dict:
        return {"released": await client.release_lease(body.ctx_request_id)}

    return router


def setup_ctx_frontend(state: ServerState) -> None:
    """Add the ``context_only`` handler and the release route to a ctx server."""
    state.handlers["context_only"] = ContextPhase(state.client)
    state.routers.append(release_router(state.client))
