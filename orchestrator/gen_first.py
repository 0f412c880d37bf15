"""``orchestrator.schedule_style: generation_first``: both phases leave at once.

One attempt picks a ctx server and a gen server and sends, at the same time:

- the ctx server the same ``context_only`` request as ``context_first``;
- the gen server the client's body with ``disaggregated_params = {request_type: generation_only,
  disagg_request_id, ctx_url}``. The gen server admits it (allocates its blocks), waits on the ctx
  server's lease endpoint (``POST /disagg/lease``, :mod:`pdserve.kv_wait`) until the KV is parked,
  pulls it and streams — its first token is the ctx server's ``first_gen_tokens``, sent once.

So one round trip sits before the gen phase can start (the gen server's blocks are allocated
while the ctx server prefills). A streaming client gets its first token from the ctx answer, at
once, as in ``context_first`` (not after the gen server's KV pull); the gen stream, already
requested, is merged after it (:class:`InFlightSource`, :mod:`orchestrator.progress`: no text twice
or missing; it carries token ids when migration is on). The ctx answer names the lease (released
if the stream is abandoned) and settles the cases the gen server cannot:

- the ctx attempt fails (5xx, down) → the gen request is cancelled and the pair is tried again on
  another ctx server (same ``disagg_request_id``), up to ``max_retries``;
- the first token ends the request (``finish_reason`` set) → the gen request is cancelled and the
  ctx answer is the client's, as in ``context_first``;
- the gen attempt fails before its first byte for any other reason than the wait → the parked
  lease is handed to another gen server exactly as ``context_first`` does
  (:meth:`DisaggFlow.generation_phase`, the failed gen server excluded);
- the wait ran out (the gen server's ``kv_transfer.ctx_wait_ms``; both servers have freed the
  request) → 504 with the gen server's message, no retry (an error event if the first token
  already went out).
"""

from __future__ import annotations

import asyncio
import logging
import time

from . import jsonio
from .choices import num_choices
from .disagg import DisaggFlow, Exchange, Response
from .lease import KV_SOURCE_FAILED, KVSourceFailed, Lease
from .errors import OrchestratorError
from .pools import Server
from .migration import GenPhase
from .progress import Progress
from .relay import GenStream
from .router import RouteHint
from .h1client import PendingPost
from .upstream import AttemptFailed, check_gen_answer, first_chunk, read_answer, start_post

log = logging.getLogger("orchestrator.gen_first")

WAIT_TIMEOUT = "ctx_wait_timeout"  # the error type a gen (or ctx) server gives when the wait ran out


class GenAttempt:
    """The gen half of one generation_first attempt, with no task of its own: :meth:`send` writes
    its request right after the ctx request was written (:meth:`DisaggFlow._context_attempt`'s
    ``then``), the answer's bytes wait in the connection's buffer while the ctx answer is awaited,
    and :meth:`response` reads them afterwards: the opened :class:`GenStream` (first byte, i.e. the
    KV pulled; then the relay owns it) or, for a JSON request, the gen server's answer.

    Counts one in-flight request on ``server`` from :meth:`send` until it fails, is discarded, or
    (a stream) the relay that took it ends. ``lease`` is set once the ctx answer names it.
    """

    def __init__(self, flow: DisaggFlow, ex: Exchange, server: Server, body: dict, streamed: bool) -> None:
        self.flow, self.ex, self.server = flow, ex, server
        self.streamed = streamed  # the gen request asks for a stream (the client's, or an internal one)
        self.lease: Lease | None = None
        self.opened_s: float | None = None  # time.monotonic() when the gen stream's first byte came
        self._body = body
        self._pending: PendingPost | None = None
        self._error: AttemptFailed | None = None
        self._deadline = 0.0
        self._counted = False
        self._taken = False

    async def send(self) -> None:
        """Encode and write the gen request now (once); a connection that cannot be made is the
        attempt's failure, raised by :meth:`response` (the ctx request is already out).

        The body (a dict until now) is encoded here, after the ctx request left: the prefill, the
        TTFT's critical path, does not wait for this encoding."""
        timeout_s = self.flow._settings.request_timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self.server.in_flight += 1
        self.server.served += 1
        self._counted = True
        body = jsonio.dumps(self._body)
        try:
            self._pending = await start_post(self.flow._client, self.server, self.ex.endpoint, body,
                                             self.ex.request_id, self.flow._auth.get("gen", ()))
        except AttemptFailed as err:
            self._error = err

    def failed_early(self) -> bool:
        """Whether the attempt already failed for sure (no connection, or a status other than 2xx
        came): then the dispatch answers as before any byte reached the client."""
        return self._error is not None or (self._pending is not None and self._pending.failed())

    async def response(self) -> Response | GenStream:
        """The opened gen stream (``streamed``; the caller owns it) or the gen server's JSON answer.
        Raises AttemptFailed / UpstreamRejected (as :func:`orchestrator.upstream.first_chunk` and
        :func:`~orchestrator.upstream.read_answer`)."""
        timeout_s = self.flow._settings.request_timeout_s
        try:
            if self._error is not None:
                raise self._error
            assert self._pending is not None
            if self.streamed:
                stream = await first_chunk(self._pending, self._deadline, "gen", timeout_s)
                self.opened_s = time.monotonic()
                self._taken = True  # its in-flight count is the relay's now
                return GenStream(self.server, stream)
            raw = await read_answer(self._pending, self._deadline, "gen", timeout_s)
        finally:
            if not self._taken:
                self._uncount()
        check_gen_answer(raw)
        return self.flow._json_response(self.ex, raw)  # relayed as the server wrote it

    def discard(self) -> None:
        """Abandon the attempt (closing its connection makes the gen server abort the request and
        free its blocks); a stream already taken by :meth:`response` is the relay's to close."""
        if self._taken:
            return
        if self._pending is not None:
            self._pending.close()
        self._uncount()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.server.in_flight -= 1


class InFlightSource:
    """The :class:`orchestrator.relay.GenSource` of a generation_first stream: the first gen stream
    is the one :class:`GenAttempt` requested with the ctx request. If that attempt fails before
    its first byte, ``phase`` hands the parked lease to another gen server (or, the KV source
    lost, prefills again on another ctx server), as context_first does; migrations and the
    lease's release go through ``phase`` too."""

    def __init__(self, flow: DisaggFlow, gen: GenAttempt, phase: GenPhase, t_answer: float) -> None:
        self._flow, self._gen, self._phase, self._t_answer = flow, gen, phase, t_answer

    async def first(self) -> GenStream:
        gen, flow = self._gen, self._flow
        try:
            gs = await gen.response()
        except AttemptFailed as err:
            failure = flow._gen_first_failed(gen.server, err)
            if err.error_type == WAIT_TIMEOUT:  # the gen server gave up on this request: so does the client
                raise OrchestratorError(504, f"generation phase failed: {failure}", kind="gen_failed",
                                        type_="timeout") from None
            if err.error_type == KV_SOURCE_FAILED:
                return await self._phase.kv_source_lost(failure)
            return await self._phase.first_elsewhere(gen.server.url, failure)
        assert isinstance(gs, GenStream)
        flow._metrics.child(flow._metrics.routed, "gen", "disaggregated").inc()
        if gen.opened_s is not None:
            # The KV handoff as context_first times it: from the parked KV (the ctx answer, here)
            # to the gen stream's first byte; 0 when that byte came before the answer was read.
            flow._metrics.kv_handoff.observe(max(gen.opened_s - self._t_answer, 0.0))
        return gs

    async def migrate(self, progress: Progress) -> GenStream:
        return await self._phase.migrate(progress)

    async def move(self, progress: Progress, moved: dict, source: Server) -> GenStream:
        return await self._phase.move(progress, moved, source)

    def abandon(self) -> None:
        self._gen.discard()
        self._phase.abandon()


class GenerationFirstFlow(DisaggFlow):
    """:class:`DisaggFlow` whose disaggregated path sends the ctx and the gen request at once."""

    async def _disaggregated(self, ex: Exchange, hint: RouteHint | None, failed_ctx: set[str]) -> Response:
        if num_choices(ex.body) > 1:  # the gen side forks n choices from first tokens it must have: context_first
            return await super()._disaggregated(ex, hint, failed_ctx)
        t0 = time.monotonic()
        ctx_server, (answer, gen) = await self._with_retries("ctx", lambda s: self._both(ex, s, hint), hint,
                                                             set(failed_ctx))
        t_answer = time.monotonic()
        self._metrics.ctx_phase.observe(t_answer - t0)
        self._metrics.child(self._metrics.routed, "ctx", "disaggregated").inc()
        if answer["choices"][0].get("finish_reason") is not None:
            gen.discard()
            return self._final_from_ctx(ex, answer)
        lease = gen.lease = Lease(ctx_server.url, answer["choices"][0]["disaggregated_params"]["ctx_request_id"])
        if gen.streamed and not gen.failed_early():
            # First token at once, as context_first: the client gets the ctx answer's token now,
            # the gen stream (already requested) is merged after it. A non-streaming request's
            # internal stream goes through the same relay (so it migrates and moves) and is
            # answered as the JSON the relay assembles.
            return await self._relayed(ex, hint, answer, lease, failed_ctx,
                                       wrap=lambda phase: InFlightSource(self, gen, phase, t_answer))
        try:
            response = await gen.response()
        except AttemptFailed as err:
            return await self._after_gen_failed(ex, hint, ctx_server, answer, failed_ctx, gen, err)
        except BaseException:  # a 4xx (relayed), or the client left: nobody will pull
            self.release_soon(lease, ex)
            raise
        if isinstance(response, GenStream):  # failed_early() said a stream's answer was not 2xx
            raise AssertionError("generation_first: a 2xx gen stream after a failed status")
        self._metrics.child(self._metrics.routed, "gen", "disaggregated").inc()
        return response

    async def _both(self, ex: Exchange, ctx_server: Server, hint: RouteHint | None) -> tuple[dict, GenAttempt]:
        """One attempt: the ctx request goes out, then at once the gen request; returns the ctx answer
        and the running gen half. Raises AttemptFailed (the ctx attempt failed: the pair is retried).

        Why the ctx request first: it is the TTFT's critical path (its server starts the prefill at
        once), while the gen server only allocates and then waits for that prefill anyway."""
        gen_router = self._routers["gen"]
        if hint is not None and hint.pending is not None and gen_router.holds_blocks(self._pools.gen):
            hint.resolve()  # a gen server holds blocks now: this pick may depend on them
        gen_server = gen_router.pick(self._pools.gen, set(), hint)
        if gen_server is None:
            raise OrchestratorError(503, f"generation phase impossible: no ready gen server "
                                    f"({self._pools.not_ready_reason() or 'all tried'})", kind="gen_failed",
                                    type_="service_unavailable")
        migrate = self._settings.migration_limit > 0
        # With migration on, a non-streaming request is streamed internally from the gen server (as
        # context_first does), so that it can migrate or move like a client's stream.
        streamed = ex.stream or migrate
        dp = {"request_type": "generation_only", "disagg_request_id": ex.disagg_request_id, "ctx_url": ctx_server.url}
        if migrate:
            # The relay keeps the output token ids, so it can migrate the stream, or move it when
            # its gen server drains with move_kv (GenPhase.move, as for a context_first stream).
            dp["stream_token_ids"] = dp["movable"] = True
        if streamed and ex.parses:  # a stream is relayed (and parsed) here; a JSON answer is the server's own
            dp["raw_output"] = True
        if ex.relay_head is not None:  # the stream passes through as bytes (orchestrator.relay)
            dp["relay_head"] = ex.relay_head
        body = {**ex.body, "disaggregated_params": dp}
        if not ex.stream and streamed:  # the internal stream: its usage chunk makes the answer's usage
            body.update(stream=True, stream_options={**(ex.body.get("stream_options") or {}), "include_usage": True})
        gen = GenAttempt(self, ex, gen_server, body, streamed)  # encoded once the ctx request is out
        try:
            answer = await self._context_attempt(ex, ctx_server, then=gen.send)
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

    def _gen_first_failed(self, server: Server, err: AttemptFailed) -> str:
        """Book a gen attempt that failed before its first byte; returns how it is named in errors."""
        if err.server_fault:
            server.mark_unhealthy(str(err))
        self._metrics.errors.labels(kind="gen_attempt").inc()
        log.warning("generation phase (generation_first) on %s failed: %s", server.url, err)
        return f"{server.name} {server.url}: {err}"

    async def _after_gen_failed(self, ex: Exchange, hint: RouteHint | None, ctx_server: Server, answer: dict,
                                failed_ctx: set[str], gen: GenAttempt, err: AttemptFailed) -> Response:
        """The gen half failed before its first byte and before the client got anything; the lease of
        ``answer`` still holds (unless the wait ran out, which ends the request)."""
        server = gen.server
        failure = self._gen_first_failed(server, err)
        if err.error_type == WAIT_TIMEOUT:  # the ctx server freed it too; releasing again is harmless
            self.release_soon(gen.lease, ex)
            raise OrchestratorError(504, f"generation phase on {server.url} failed: {err}", kind="gen_failed",
                                    type_="timeout") from None
        if err.error_type == KV_SOURCE_FAILED:
            self.release_soon(gen.lease, ex)
            failed_ctx.add(ctx_server.url)
            raise KVSourceFailed(failure) from None
        return await self.generation_phase(ex, hint, ctx_server, answer, failed_ctx, exclude={server.url},
                                           failures=[failure])
