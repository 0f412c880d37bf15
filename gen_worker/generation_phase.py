"""Frontend side of the generation role: the ``generation_only`` handler.

The worker side (``gen_worker.kv_role``) pulls the KV; this handler refuses a mismatched KV layout
before anything is allocated (409, naming both values) and records the pull in the metrics. The
first output is ``first_gen_tokens`` (sampled by the ctx server), sent once.

generation_first (``DisaggregatedParams.awaits_ctx``): the request is submitted at once (the
engine allocates its blocks and the role holds its pull) while this handler waits on the ctx
server's lease endpoint (``gen_worker.ctx_wait``); the answer's params go to the worker side
(``kv_source_ready``) and the pull starts. A wait that fails ends the request with its error,
and closing the engine stream frees the blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from engine.request import EngineRequest, RequestOutput
from executor.engine_client import EngineClient
from executor.http_server import ServerState
from executor.kv_role import KVMoved, KVTransferDone
from executor.metrics import ServerMetrics
from executor.phases import PhaseAnswer, PhaseError
from gen_worker.ctx_wait import CtxWaiter
from kv_transfer.layout import KVLayout, KVLayoutMismatch, check_tp_pairing
from pdserve import request_id as request_ids
from pdserve.protocol import DisaggregatedParams


class GenerationPhase:
    """Runs ``generation_only`` requests: KV pull (worker side), then decode."""

    def __init__(self, client: EngineClient, layouts: list[KVLayout], metrics: ServerMetrics,
                 waiter: CtxWaiter | None = None, vocab_size: int = 2**31) -> None:
        self.client, self.layouts, self.metrics = client, layouts, metrics
        self.waiter, self.vocab_size = waiter, vocab_size

    async def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                       answer: PhaseAnswer) -> AsyncIterator[RequestOutput]:
        assert params is not None  # enforced by DisaggregatedParams
        if params.awaits_ctx:
            stream = self._generation_first(request, params)
        else:
            self._check_layout(params)
            stream = self.client.generate(request, params)
        async for item in stream:
            if isinstance(item, KVTransferDone):  # counted by the worker side (pdserve_kv_transfer_*)
                continue
            if isinstance(item, KVMoved):  # drained with move_kv: the final output (reason "moved") follows
                answer.add_moved(item)
                continue
            yield item

    def _check_layout(self, params: DisaggregatedParams) -> None:
        assert params.kv_layout is not None  # enforced by DisaggregatedParams
        try:
            check_tp_pairing(self.layouts, params.kv_layouts or [params.kv_layout])
        except KVLayoutMismatch as err:
            self.metrics.errors.labels(kind="kv_layout_mismatch").inc()
            raise PhaseError(str(err), 409, "kv_layout_mismatch") from None

    async def _generation_first(self, request: EngineRequest, params: DisaggregatedParams) -> AsyncIterator[object]:
        """Submit now, wait for the ctx server's KV meanwhile, then hand the source to the worker side."""
        if self.waiter is None:
            raise PhaseError("this gen server cannot wait for ctx servers", 500, "internal")
        stream = self.client.generate(request, params)
        first = asyncio.ensure_future(stream.__anext__())  # submits: the engine allocates, the pull is held
        wait = asyncio.ensure_future(self.waiter.wait(params.ctx_url, params.disagg_request_id,
                                                      request_ids.current.get()))
        try:
            await asyncio.wait({first, wait}, return_when=asyncio.FIRST_COMPLETED)
            if wait.done():
                src = wait.result()  # PhaseError: the ctx side failed or ran out of time
                self._check_source(request, src)
                self.client.kv_source_ready(request.request_id, src)
                await asyncio.wait({first})
            try:
                item = first.result()  # raises the request's error (e.g. it ended before its KV came)
            except StopAsyncIteration:
                return
            yield item
            async for item in stream:
                yield item
        finally:
            for task in (wait, first):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await task
            await stream.aclose()  # an unfinished stream aborts the request: its blocks are freed

    def _check_source(self, request: EngineRequest, src: DisaggregatedParams) -> None:
        """The ctx server's params must fit this request (same prompt, this layout) before any byte moves."""
        self._check_layout(src)
        if list(src.prompt_token_ids or []) != list(request.prompt_token_ids):
            raise PhaseError(f"the ctx server tokenized the prompt to {len(src.prompt_token_ids or [])} tokens, "
                             f"this gen server to {len(request.prompt_token_ids)}: not the same prompt", 502,
                             "prompt_mismatch")
        first = list(src.first_gen_tokens or [])
        if not first or any(t >= self.vocab_size for t in first):
            raise PhaseError(f"the ctx server's first tokens {first[:4]} do not fit a vocabulary of "
                             f"{self.vocab_size}", 502, "ctx_failed")
        if len(request.prompt_token_ids) + len(first) > self.client.max_model_len:
            raise PhaseError("prompt + first tokens exceed the context window", 400, "invalid_request_error")


def release_router(client: EngineClient) -> APIRouter:
    """``POST /disagg/release``: the orchestrator gives up the lease of a request moved off this
    (draining) server, e.g. because its client left before a target pulled it."""
    router = APIRouter()

    @router.post("/disagg/release")
    async def release(body: ReleaseBody) -> dict:
        return {"released": await client.release_lease(body.ctx_request_id)}

    return router


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ctx_request_id: str


def setup_gen_frontend(state: ServerState) -> None:
    """Add the ``generation_only`` handler to a gen server (and the HTTP client its waits use), and
    the release route of moved requests' leases."""
    waiter = CtxWaiter(state.config.kv_transfer.ctx_wait_ms)
    state.on_shutdown.append(waiter.close)
    state.handlers["generation_only"] = GenerationPhase(state.client, state.kv_layouts or [state.kv_layout],
                                                        state.metrics, waiter, state.vocab_size)
    state.routers.append(release_router(state.client))
