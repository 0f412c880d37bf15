"""``orchestrator.schedule_style: generation_first``: both phases leave at once.

One attempt picks a ctx server and a gen server and sends, at the same time:

- the ctx server the same ``context_only`` request as ``context_first``;
- the gen server the client's body with ``disaggregated_params = {request_type: generation_only,
  disagg_request_id, ctx_url}``. The gen server admits it (allocates its blocks), waits on the ctx
  server's lease endpoint (``POST /disagg/lease``, :mod:`pdserve.kv_wait`) until the KV is parked,
  pulls it and streams — its first token is the ctx server's ``first_gen_tokens``, sent once.

So one round trip sits on the client's critical path (the orchestrator → gen stream; the ctx
answer arrives meanwhile). The ctx answer still comes back here: it names the lease (released if
the stream is abandoned) and settles the cases the gen server cannot:

- the ctx attempt fails (5xx, down) → the gen request is cancelled and the pair is tried again on
  another ctx server (same ``disagg_request_id``), up to ``max_retries``;
- the first token ends the request (``finish_reason`` set) → the gen request is cancelled and the
  ctx answer is the client's, as in ``context_first``;
- the gen attempt fails before its first byte for any other reason than the wait → the parked
  lease is handed to another gen server exactly as ``context_first`` does
  (:meth:`DisaggFlow.generation_phase`, the failed gen server excluded);
- the wait ran out (the gen server's ``kv_transfer.ctx_wait_ms``; both servers have freed the
  request) → 504 with the gen server's message, no retry.
"""

from __future__ import annotations

import asyncio
import logging
import time

from . import jsonio
from .disagg import KV_SOURCE_FAILED, DisaggFlow, Exchange, KVSourceFailed, Lease, Response
from .errors import OrchestratorError
from .pools import Server
from .relay import StreamAnswer
from .router import RouteHint
from .upstream import AttemptFailed

log = logging.getLogger("orchestrator.gen_first")

WAIT_TIMEOUT = "ctx_wait_timeout"  # the error type a gen (or ctx) server gives when the wait ran out


class GenAttempt:
    """The gen half of one generation_first attempt, running in its own task from the start.

    It owns that task: :meth:`response` awaits it, :meth:`discard` cancels it and closes a stream
    it may already hold. ``lease`` is set once the ctx answer names it; an abandoned stream
    releases it.
    """

    def __init__(self, flow: DisaggFlow, ex: Exchange, server: Server, body: bytes) -> None:
        self.flow, self.ex, self.server = flow, ex, server
        self.lease: Lease | None = None
        attempt = (flow._gen_stream_attempt(ex, server, body, self._abandoned) if ex.stream
                   else flow._gen_json_attempt(ex, server, body))
        self.task = asyncio.create_task(attempt, name=f"gen-first-{ex.disagg_request_id}")

    def _abandoned(self) -> None:
        if self.lease is not None:
            self.flow.release_soon(self.lease, self.ex)

    async def response(self) -> Response:
        """The gen server's response. Raises what the attempt raised (AttemptFailed, UpstreamRejected)."""
        return await self.task  # cancelling the caller cancels the task too

    def discard(self) -> None:
        """Cancel the attempt (the gen server aborts its request and frees its blocks)."""
        if not self.task.done():
            self.task.cancel()
            return
        if self.task.cancelled():
            return
        if self.task.exception() is None and isinstance(self.task.result(), StreamAnswer):
            self.task.result().close()


class GenerationFirstFlow(DisaggFlow):
    """:class:`DisaggFlow` whose disaggregated path sends the ctx and the gen request at once."""

    async def _disaggregated(self, ex: Exchange, hint: RouteHint | None, failed_ctx: set[str]) -> Response:
        t0 = time.monotonic()
        ctx_server, (answer, gen) = await self._with_retries("ctx", lambda s: self._both(ex, s, hint), hint,
                                                             set(failed_ctx))
        self._metrics.ctx_phase.observe(time.monotonic() - t0)
        self._metrics.routed.labels(pool="ctx", path="disaggregated").inc()
        if answer["choices"][0].get("finish_reason") is not None:
            gen.discard()
            return self._final_from_ctx(ex, answer)
        gen.lease = Lease(ctx_server.url, answer["choices"][0]["disaggregated_params"]["ctx_request_id"])
        try:
            response = await gen.response()
        except AttemptFailed as err:
            return await self._after_gen_failed(ex, hint, ctx_server, answer, failed_ctx, gen, err)
        except BaseException:  # a 4xx (relayed), or the client left: nobody will pull
            self.release_soon(gen.lease, ex)
            raise
        self._metrics.routed.labels(pool="gen", path="disaggregated").inc()
        return response

    async def _both(self, ex: Exchange, ctx_server: Server, hint: RouteHint | None) -> tuple[dict, GenAttempt]:
        """One attempt: the gen request goes out, then the ctx request; returns the ctx answer and the
        running gen half. Raises AttemptFailed (the ctx attempt failed: the pair is retried)."""
        gen_server = self._routers["gen"].pick(self._pools.gen, set(), hint)
        if gen_server is None:
            raise OrchestratorError(503, f"generation phase impossible: no ready gen server "
                                    f"({self._pools.not_ready_reason() or 'all tried'})", kind="gen_failed",
                                    type_="service_unavailable")
        params = {"request_type": "generation_only", "disagg_request_id": ex.disagg_request_id, "ctx_url": ctx_server.url}
        if ex.stream and ex.parses:  # a stream is relayed (and parsed) here; a JSON answer is the server's own
            params["raw_output"] = True
        body = jsonio.dumps({**ex.body, "disaggregated_params": params})
        gen = GenAttempt(self, ex, gen_server, body)
        try:
            answer = await self._context_attempt(ex, ctx_server)
        except AttemptFailed as err:
            gen.discard()
            if err.error_type == WAIT_TIMEOUT:  # the gen server gave up on this request: so does the client
                raise OrchestratorError(504, f"context phase on {ctx_server.url} failed: {err}", kind="gen_failed",
                                        type_="timeout") from None
            raise
        except BaseException:
            gen.discard()
            raise
        return answer, gen

    async def _after_gen_failed(self, ex: Exchange, hint: RouteHint | None, ctx_server: Server, answer: dict,
                                failed_ctx: set[str], gen: GenAttempt, err: AttemptFailed) -> Response:
        """The gen half failed before its first byte; the lease of ``answer`` still holds (unless the
        wait ran out, which ends the request)."""
        server = gen.server
        if err.server_fault:
            server.mark_unhealthy(str(err))
        self._metrics.errors.labels(kind="gen_attempt").inc()
        log.warning("generation phase (generation_first) on %s failed: %s", server.url, err)
        if err.error_type == WAIT_TIMEOUT:  # the ctx server freed it too; releasing again is harmless
            self.release_soon(gen.lease, ex)
            raise OrchestratorError(504, f"generation phase on {server.url} failed: {err}", kind="gen_failed",
                                    type_="timeout") from None
        if err.error_type == KV_SOURCE_FAILED:
            self.release_soon(gen.lease, ex)
            failed_ctx.add(ctx_server.url)
            raise KVSourceFailed(f"{server.name} {server.url}: {err}") from None
        return await self.generation_phase(ex, hint, ctx_server, answer, failed_ctx, exclude={server.url},
                                           failures=[f"{server.name} {server.url}: {err}"])

