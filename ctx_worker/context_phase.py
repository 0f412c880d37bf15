"""Frontend side of the context role: the ``context_only`` handler, ``POST /disagg/release`` and
(generation_first) ``POST /disagg/lease``, the gen servers' waiting pull (:mod:`pdserve.kv_wait`).

The worker side (``ctx_worker.kv_role``) parks the blocks and hands back the answer's
``disaggregated_params``: where the blocks are (``kv_endpoint``), how they are laid out
(``kv_layout``), how many to pull (``kv_block_count`` = ceil(prompt tokens / block_size)) and until
when they are kept (``lease_deadline``, unix seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from engine.request import EngineRequest, RequestOutput
from executor.engine_client import EngineClient
from executor.disconnect import unless_client_leaves
from executor.http_server import ServerState
from executor.kv_role import KVHandoff
from executor.phases import PhaseAnswer
from pdserve.kv_wait import LEASE_PATH, LeaseWaitAnswer, LeaseWaitBody
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

    @router.post(LEASE_PATH)
    async def lease(body: LeaseWaitBody, request: Request) -> dict:
        return (await wait_for_lease(client, body, request)).model_dump(mode="json", exclude_none=True)

    return router


async def wait_for_lease(client: EngineClient, body: LeaseWaitBody, request: Request) -> LeaseWaitAnswer:
    """The outcome of ``body.disagg_request_id``'s context phase, waiting at most ``body.wait_ms``.

    The engine side answers (any frontend may hold the wait: the outcome is known to rank 0). A
    wait that runs out abandons the request there (aborted or lease released); a gen server that
    hangs up cancels its wait without abandoning (the orchestrator may still hand the lease to
    another gen server).
    """
    task = asyncio.create_task(client.await_lease(body.disagg_request_id, body.wait_ms / 1000.0))
    try:
        if await unless_client_leaves(task, request):
            return LeaseWaitAnswer(state="failed", message="the waiter hung up")  # nobody reads it
        return task.result()
    except TimeoutError:
        return LeaseWaitAnswer(state="timeout", message=f"nothing parked for {body.disagg_request_id} within "
                               f"{body.wait_ms} ms; this ctx server freed the request")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def setup_ctx_frontend(state: ServerState) -> None:
    """Add the ``context_only`` handler and the release route to a ctx server."""
    state.handlers["context_only"] = ContextPhase(state.client)
    state.routers.append(release_router(state.client))
