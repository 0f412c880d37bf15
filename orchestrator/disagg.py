"""The disaggregated request path: context phase on a ctx server, generation phase on a gen server.

1. Context phase: POST a copy of the client body with ``stream: false``, no ``stream_options`` and
   ``disaggregated_params = {request_type: context_only, disagg_request_id}``. Retried on the next
   ctx server (same ``disagg_request_id``) on 5xx / transport errors / timeouts; 4xx is relayed.
2. If the ctx answer is already final (``finish_reason`` set), it is the client's answer
   (converted to SSE when the client streams).
3. Generation phase: POST the client body with the ctx's params as ``generation_only``. Retried on
   another gen server before its first byte (its KV pull is not confirmed: the lease still holds).
   If the phase is abandoned, the ctx lease is released.
   * A streaming client gets the ctx server's first token at once, then the gen stream merged
     into it (:mod:`orchestrator.relay`, :mod:`orchestrator.progress`: no text twice or missing).
   * With ``orchestrator.migration_limit`` > 0 a non-streaming request is streamed internally too,
     and a gen server that dies mid-decode is replaced (:mod:`orchestrator.migration`).
   * With ``migration_limit`` 0 a non-streaming gen answer is relayed as the server wrote it.

A body without ``seed`` gets one here (63 random bits), so the ctx server, the gen server and a
migration target sample with the same seed (the engine would otherwise draw one per server).
The bits come from the ``random`` module (seeded from the OS at import, reseeded in a forked
child): a sampling seed needs no unpredictability, and ``secrets`` cost a ``getrandom`` call per
request (2.0 vs 0.14 µs).

That is ``orchestrator.schedule_style: context_first``; ``generation_first`` (both phases sent at
once, the gen server waits for the ctx server's KV) is :class:`orchestrator.gen_first.GenerationFirstFlow`,
a subclass that replaces :meth:`DisaggFlow._disaggregated` and reuses the attempts and
:meth:`DisaggFlow.generation_phase` here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pdserve.config import OrchestratorSettings, Role
from pdserve.output_parser import OutputParser, ReasoningParserName, ToolCallParserName, output_parser
from pdserve.tool_use import NO_TOOLS, ToolUse

from . import jsonio
from .choices import ChoicesProgress, all_finished, num_choices
from .choices_relay import ChoicesRelay
from .ctx_answer import parse_ctx_answer
from .errors import OrchestratorError
from .h1client import H1Client
from .kv_selfcheck import HitSelfCheck, reported_hit
from .lease import KV_SOURCE_FAILED, KVSourceFailed, Lease
from .metrics import Metrics
from .pools import ClusterPools, Server
from .migration import GenPhase
from .progress import Progress
from .relay import GenRelay, GenSource, GenStream, StreamAnswer
from .prompt_tokens import PromptTokenizer
from .responses import EventStream, JSONAnswer, iterate
from .prompt_blocks import PromptBlocks, prompt_blocks
from .router import RouteHint, Router
from .sse import answer_to_events
from .tasks import TaskOwner
from .upstream import (AttemptFailed, check_gen_answer, open_stream, post_json_raw, read_answer, release_lease,
                       start_post)

Response = JSONAnswer | EventStream | StreamAnswer

log = logging.getLogger("orchestrator.disagg")

T = TypeVar("T")
RELEASE_TIMEOUT_S = 2.0
PHASE_NAMES = {"ctx": "context phase", "gen": "generation phase"}


class _RequestIds:
    """``disagg-`` + 32 hex digits: 64 random bits drawn once per process, then a counter (a uuid4
    per request cost a ``getrandom`` call and a UUID object on the hot path). Drawn again in a
    forked child (another pid), so no two orchestrator processes share the random half."""

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._count = itertools.count()

    def next(self) -> str:
        if self._pid != os.getpid():
            self._pid, self._prefix, self._count = os.getpid(), os.urandom(8).hex(), itertools.count()
        return f"disagg-{self._prefix}{next(self._count):016x}"


_DISAGG_IDS = _RequestIds()


@dataclass
class Exchange:
    """One client request on its way through the cluster."""

    endpoint: str  # "/v1/chat/completions" or "/v1/completions"; also the upstream path
    body: dict     # the client's body as received (already validated)
    request_id: str | None = None  # the client's X-Request-Id (or one made for it): sent to every server
    session: str | None = None     # session-affinity key (header or `user` field), when configured
    disagg_request_id: str = field(default_factory=lambda: _DISAGG_IDS.next())
    started_s: float = field(default_factory=time.monotonic)
    hint: RouteHint | None = None  # what the routers know about the prompt (set by DisaggFlow.handle)
    colocated: bool = False        # runs both phases on one gen server (conditional disaggregation)
    tools: ToolUse = NO_TOOLS      # what tools/tool_choice ask (checked at validation)
    parses: bool = False           # chat text is parsed (reasoning, tool calls): relayed streams ask for raw text
    choice_index: int | None = None  # continues this choice of an n > 1 request (n = 1 body; orchestrator.choices)
    # A disaggregated stream relayed as bytes: the id and created its chunks carry, asked of every
    # gen server as disaggregated_params.relay_head (None: each event is parsed and rewritten here).
    relay_head: dict | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream", False))

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


class DisaggFlow:
    """Runs :class:`Exchange` objects through ctx then gen; one instance per app.

    ``routers`` holds one router per pool. ``tokenizer`` gives prompt token ids when a router or
    conditional disaggregation needs them (``None``: never needed). ``parsers``: the model's
    ``tool_call_parser`` and ``reasoning_parser`` (``model.*``), run on every stream relayed here.
    """

    def __init__(self, pools: ClusterPools, routers: dict[str, Router], client: H1Client,
                 settings: OrchestratorSettings, metrics: Metrics, tasks: TaskOwner,
                 tokenizer: PromptTokenizer | None = None, block_size: int = 16, model: str = "",
                 dtype: str = "", selfcheck: HitSelfCheck | None = None,
                 auth: dict[str, tuple[tuple[str, str], ...]] | None = None,
                 parsers: tuple[ToolCallParserName, ReasoningParserName] = ("none", "none")) -> None:
        self._pools = pools
        self._routers = routers
        self._client = client
        self._settings = settings
        self._metrics = metrics
        self._tasks = tasks
        self._tokenizer = tokenizer
        self._block_size = block_size
        self._model, self._dtype = model, dtype  # with block_size: what names a KV block (pdserve.block_hash)
        self._selfcheck = selfcheck  # predicted vs reported prefix-cache hits (None: not kept)
        self._auth = auth or {}  # per pool: the Authorization header its servers require (pools.<role>.api_key_env)
        self._parsers = parsers

    async def _route_hint(self, ex: Exchange) -> RouteHint | None:
        """What the routers get to know about ``ex``'s prompt (None: nothing).

        When no ready server's KV index holds a block, no pick can depend on the prompt's blocks,
        so tokenizing waits: the hint is *pending* (:meth:`RouteHint.resolve`), and is resolved
        only before a pick whose pool holds a block by then (:meth:`_with_retries`, a migration's
        new prefill) or when a ctx answer lacks ``usage.prompt_tokens`` (the hit self-check reads
        the prompt's length there: :meth:`_check_pending_hits`). Usually it never is: a request
        in front of servers whose caches hold nothing is not tokenized at all. The picks made on
        a pending hint are the same ones the blocks would give."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            return RouteHint(session=ex.session) if ex.session else None
        if self._settings.max_local_prefill_length <= 0 and tokenizer.inline(ex.body) and not any(
                r.holds_blocks(self._pools.pool(role)) for role, r in self._routers.items()):
            return RouteHint(session=ex.session, pending=lambda: self._blocks_of(ex, tokenizer.token_ids_now(
                ex.endpoint, ex.body)))
        found = self._blocks_of(ex, await tokenizer.token_ids(ex.endpoint, ex.body))
        if found is None:
            return RouteHint(session=ex.session) if ex.session else None
        return RouteHint(*found, session=ex.session)

    def _blocks_of(self, ex: Exchange, ids: list[int] | None) -> tuple[PromptBlocks, int] | None:
        """The prompt's lazily hashed blocks and its length (tokens) for ``ids`` (None: None)."""
        if ids is None:
            return None
        dtype = self._dtype if self._dtype != "auto" else (self._pools.accepted_dtype() or self._dtype)
        # Lazily hashed: the routers read only as far as the longest prefix some server holds.
        return prompt_blocks(ids, self._block_size, self._model, dtype, ex.body.get("cache_salt")), len(ids)

    def _is_short(self, hint: RouteHint | None) -> bool:
        """Conditional disaggregation: the prompt's *uncached* length (its tokens less the prefix the
        gen pool's router believes a gen server holds, where the router keeps such a record:
        ``kv_cache_aware``) is below ``max_local_prefill_length``: prefill it on a gen server."""
        limit = self._settings.max_local_prefill_length
        if limit <= 0 or hint is None:
            return False
        return hint.num_tokens - self._predicted_gen_hit_tokens(hint) < limit

    def _predicted_gen_hit_tokens(self, hint: RouteHint) -> int:
        router = self._routers.get("gen")
        router = getattr(router, "inner", router)  # session affinity wraps the policy
        predict = getattr(router, "predicted_hit_blocks", None)
        if predict is None or not hint.block_hashes:
            return 0
        # As the servers' cache does: at most num_tokens - 1 tokens come from the cache.
        return min(predict(self._pools.gen, hint) * self._block_size, hint.num_tokens - 1)

    def output_parser(self, ex: Exchange) -> OutputParser | None:
        """A new parser of ``ex``'s answer text (None: the text is the client's as is)."""
        return output_parser(ex.tools, *self._parsers) if ex.chat else None

    async def handle(self, ex: Exchange) -> Response:
        """The client's response. Raises :class:`OrchestratorError` (4xx relay, 503 when a phase fails)."""
        if not self._pools.gen.any_ready():  # fail fast: no prefill (and parked lease) nobody could pull
            raise OrchestratorError(503, f"no ready gen server ({self._pools.not_ready_reason()})",
                                    kind="gen_failed", type_="service_unavailable")
        if ex.body.get("seed") is None:  # one seed for every server the request meets
            ex.body = {**ex.body, "seed": random.getrandbits(63)}
        # n > 1 too: each choice's text is parsed here by its own parser (orchestrator.choices)
        ex.parses = self.output_parser(ex) is not None
        ex.relay_head = relay_head(ex)
        hint = ex.hint = await self._route_hint(ex)
        if self._is_short(hint):
            return await self._colocated(ex, hint)
        self._metrics.queue.observe(time.monotonic() - ex.started_s)
        failed_ctx: set[str] = set()
        while True:
            try:
                return await self._disaggregated(ex, hint, failed_ctx)
            except KVSourceFailed as err:
                # The ctx server that parked the KV died or lost it (e.g. kill -9 mid-transfer).
                # Nothing reached the client yet, so the whole request may start over on another
                # ctx server: no output is ever duplicated.
                if len(failed_ctx) >= self._settings.max_retries:
                    raise OrchestratorError(503, f"generation phase failed: {err}", kind="gen_failed",
                                            type_="service_unavailable") from None
                log.warning("KV source failed (%s); restarting the request on another ctx server", err)
                self._metrics.retries.labels(pool="ctx").inc()

    async def _disaggregated(self, ex: Exchange, hint: RouteHint | None, failed_ctx: set[str]) -> Response:
        t0 = time.monotonic()
        ctx_server, answer = await self._with_retries("ctx", lambda s: self._context_attempt(ex, s), hint,
                                                      set(failed_ctx))
        self._metrics.ctx_phase.observe(time.monotonic() - t0)
        self._metrics.child(self._metrics.routed, "ctx", "disaggregated").inc()
        if all_finished(answer):
            return self._final_from_ctx(ex, answer)
        return await self.generation_phase(ex, hint, ctx_server, answer, failed_ctx)

    async def generation_phase(self, ex: Exchange, hint: RouteHint | None, ctx_server: Server, answer: dict,
                               failed_ctx: set[str], exclude: set[str] | None = None,
                               failures: list[str] | None = None) -> Response:
        """The gen phase of a parked ctx ``answer`` (on gen servers not in ``exclude``, after the attempts
        ``failures`` describe); the lease is released on any way out but a response.
        Raises KVSourceFailed, OrchestratorError, UpstreamRejected."""
        params = answer["choices"][0]["disaggregated_params"]
        lease = Lease(ctx_server.url, params["ctx_request_id"])
        if num_choices(ex.body) > 1 and (ex.stream or self._settings.migration_limit):
            return await self._relayed_choices(ex, hint, answer, lease, failed_ctx, exclude, failures)
        if ex.stream or self._settings.migration_limit:
            return await self._relayed(ex, hint, answer, lease, failed_ctx, exclude, failures)
        gen_body = jsonio.dumps({**ex.body, "disaggregated_params": {
            **params, "request_type": "generation_only", "disagg_request_id": ex.disagg_request_id}})
        handed_over = False
        try:
            _, response = await self._with_retries("gen", lambda s: self._gen_json_attempt(ex, s, gen_body), hint,
                                                   exclude, failures)
            self._metrics.child(self._metrics.routed, "gen", "disaggregated").inc()
            handed_over = True
            return response
        except KVSourceFailed:
            failed_ctx.add(ctx_server.url)
            raise
        finally:
            # Any way out but a response (error, cancellation) abandons the gen phase.
            if not handed_over:
                self.release_soon(lease, ex)

    async def _colocated(self, ex: Exchange, hint: RouteHint | None) -> Response:
        """A short prompt: prefill and decode on one gen server (no KV handoff)."""
        ex.colocated = True
        ex.relay_head = None  # its first stream names the head and the role: every chunk is merged here
        self._metrics.queue.observe(time.monotonic() - ex.started_s)
        self._metrics.child(self._metrics.routed, "gen", "colocated").inc()
        if num_choices(ex.body) > 1 and (ex.stream or self._settings.migration_limit):
            return await self._relayed_choices(ex, hint, None, None, set())
        if ex.stream or self._settings.migration_limit:
            return await self._relayed(ex, hint, None, None, set())
        body = jsonio.dumps(ex.body)
        _, response = await self._with_retries("gen", lambda s: self._gen_json_attempt(ex, s, body), hint)
        return response

    async def _relayed(self, ex: Exchange, hint: RouteHint | None, answer: dict | None, lease: Lease | None,
                       failed_ctx: set[str], exclude: set[str] | None = None,
                       failures: list[str] | None = None,
                       wrap: Callable[[GenPhase], GenSource] | None = None) -> Response:
        """The gen phase through :class:`GenRelay`: a stream that starts with the ctx answer's first
        token (``answer``; None on the colocated path), or (not ``ex.stream``) the JSON answer
        assembled from an internal stream. ``wrap``: the source the relay reads instead of the
        :class:`GenPhase` it is given (generation_first: a gen stream already requested). Raises
        OrchestratorError (non-stream only: a stream's failures after its first byte are error events)."""
        progress = Progress.for_body(ex.body, ex.chat, self.output_parser(ex))
        first = None
        if answer is not None:
            first = progress.take_ctx_answer(answer, ex.relay_head)
        include_usage = bool((ex.body.get("stream_options") or {}).get("include_usage", False))
        migrate = self._settings.migration_limit > 0
        phase = GenPhase(self, ex, hint, progress, lease, None if answer is None else
                         answer["choices"][0]["disaggregated_params"], failed_ctx, token_ids=migrate,
                         want_usage=include_usage or not ex.stream, exclude_gen=exclude,
                         failures=failures)
        source: GenSource = phase if wrap is None else wrap(phase)
        relay = GenRelay(progress, source, self._settings.migration_limit, self._metrics, ex.endpoint,
                         ex.started_s + self._settings.request_timeout_s, include_usage)
        if ex.stream:
            head = None if first is None else b"data: " + jsonio.dumps(progress.first_chunk(first)) + b"\n\n"
            return StreamAnswer(relay, source, head, ex.started_s, self._metrics, ex.endpoint)
        await run_to_end(relay, source)
        answer = progress.answer()
        if ex.colocated and relay.migrations == 0 and phase.first_stream is not None:
            self._check_hits("gen", ex, phase.first_stream.predicted, answer)  # its hit is its own
        return self._json_response(ex, answer)

    async def _relayed_choices(self, ex: Exchange, hint: RouteHint | None, answer: dict | None, lease: Lease | None,
                               failed_ctx: set[str], exclude: set[str] | None = None,
                               failures: list[str] | None = None) -> Response:
        """An n > 1 request's gen phase through :class:`ChoicesRelay` (the ctx ``answer`` and its
        ``lease``: None colocated): a stream, or (not ``ex.stream``) the JSON answer assembled from
        an internal stream. With ``migration_limit`` > 0 each unfinished choice of a stream that
        breaks continues on another gen server (:mod:`orchestrator.choices`). Raises
        OrchestratorError (non-stream only)."""
        progress = ChoicesProgress.for_body(ex.body, ex.chat, lambda: self.output_parser(ex) if ex.parses else None)
        if answer is not None:
            progress.take_ctx_answer(answer)
        include_usage = bool((ex.body.get("stream_options") or {}).get("include_usage", False))
        migrate = self._settings.migration_limit > 0
        params = None if answer is None else answer["choices"][0]["disaggregated_params"]
        source = GenPhase(self, ex, hint, progress, lease, params, failed_ctx,  # type: ignore[arg-type]
                          token_ids=migrate, want_usage=include_usage or not ex.stream, exclude_gen=exclude,
                          failures=failures)
        relay = ChoicesRelay(progress, source, lambda i, avoid: self._choice_phase(ex, hint, progress, i, avoid),
                             self._settings.migration_limit, self._metrics, ex.endpoint,
                             ex.started_s + self._settings.request_timeout_s, include_usage)
        if ex.stream:
            return StreamAnswer(relay, source, None, ex.started_s, self._metrics, ex.endpoint)  # type: ignore[arg-type]
        await run_to_end(relay, source)
        return self._json_response(ex, progress.answer())

    def _choice_phase(self, ex: Exchange, hint: RouteHint | None, progress: ChoicesProgress, i: int,
                      avoid: set[str]) -> GenPhase:
        """An n = 1 gen phase continuing choice ``i`` of ``ex`` (its own disagg_request_id, no parked
        KV yet: its first stream prefills the prompt again, orchestrator.choices_relay; that stream
        not on the gen servers in ``avoid``)."""
        child = dataclasses.replace(ex, body={**ex.body, "n": 1}, disagg_request_id=f"{ex.disagg_request_id}-c{i}",
                                    colocated=False, choice_index=i)
        return GenPhase(self, child, hint, progress.choices[i], None, None, set(), token_ids=True, want_usage=True,
                        exclude_gen=avoid)

    def release_soon(self, lease: Lease, ex: Exchange) -> None:
        """Release ``lease`` in a background task owned by the app (best effort, short timeout)."""
        self._tasks.spawn(release_lease(self._client, lease.ctx_url, lease.ctx_request_id, RELEASE_TIMEOUT_S,
                                        ex.request_id), name=f"release-{lease.ctx_request_id}")

    async def _with_retries(self, role: Role, attempt: Callable[[Server], Awaitable[T]],
                            hint: RouteHint | None = None, exclude: set[str] | None = None,
                            failures: list[str] | None = None) -> tuple[Server, T]:
        """Run ``attempt`` on up to ``1 + max_retries`` distinct ready servers of pool ``role``
        (``failures``: attempts that already failed elsewhere, named in the error and counted).

        Raises:
            OrchestratorError: 503 naming every failed attempt, or that no server was ready.
            UpstreamRejected: a server answered 4xx (relayed, not retried).
        """
        tried: set[str] = set(exclude or ())
        failures = list(failures or ())
        router, pool = self._routers[role], self._pools.pool(role)
        for n in range(len(failures), 1 + self._settings.max_retries):
            if hint is not None and hint.pending is not None and router.holds_blocks(pool):
                hint.resolve()  # this pick may depend on the blocks now: tokenize and hash (once)
            server = router.pick(pool, tried, hint)
            if server is None:
                break
            if n:
                self._metrics.retries.labels(pool=role).inc()
            tried.add(server.url)
            try:
                return server, await attempt(server)
            except AttemptFailed as err:
                if err.server_fault:
                    server.mark_unhealthy(str(err))
                self._metrics.errors.labels(kind=f"{role}_attempt").inc()
                failures.append(f"{server.name} {server.url}: {err}")
                log.warning("%s attempt on %s failed: %s", PHASE_NAMES[role], server.url, err)
                if role == "gen" and err.error_type == KV_SOURCE_FAILED:
                    raise KVSourceFailed(failures[-1]) from None  # another gen server cannot pull either
        phase = PHASE_NAMES[role]
        if failures:
            msg = f"{phase} failed on {len(failures)} {role} server(s): " + "; ".join(failures)
        else:
            msg = f"{phase} impossible: no ready {role} server ({self._pools.not_ready_reason() or 'all tried'})"
        raise OrchestratorError(503, msg, kind=f"{role}_failed", type_="service_unavailable")

    def _predict(self, server: Server, hint: RouteHint | None) -> int | None:
        """Hit tokens the KV index predicts on ``server`` now (call before the first await: at pick time)."""
        return None if self._selfcheck is None else self._selfcheck.predict(server.url, hint)

    def _check_hits(self, role: Role, ex: Exchange, predicted: int | None, answer: object,
                    prompt_tokens: int | None = None) -> None:
        if self._selfcheck is not None:
            self._selfcheck.record(role, ex.hint, predicted, reported_hit(answer), prompt_tokens)

    async def _context_attempt(self, ex: Exchange, server: Server,
                               then: Callable[[], Awaitable[None]] | None = None) -> dict:
        """One context phase on ``server``: its checked answer. ``then`` is awaited once the ctx
        request is written and before its answer is read (generation_first writes its gen request
        there: the prefill starts first, and no task is needed for either request).

        Raises AttemptFailed (retry elsewhere), UpstreamRejected (4xx, relayed), or what ``then`` raises."""
        hint = ex.hint
        pending = hint is not None and hint.pending is not None
        # At pick time (before any await); a pending hint: the server held no block then (its
        # prediction is 0 or, unsynced, None).
        predicted = self._predict(server, hint) if not pending else None
        synced = pending and self._selfcheck is not None and self._selfcheck.synced(server.url)
        dp = {"request_type": "context_only", "disagg_request_id": ex.disagg_request_id}
        if ex.choice_index is not None:  # its first token: the one this choice sampled
            dp["choice_index"] = ex.choice_index
        body = {**ex.body, "stream": False, "disaggregated_params": dp}
        body.pop("stream_options", None)
        timeout_s = self._settings.request_timeout_s
        with server.track():
            deadline = asyncio.get_running_loop().time() + timeout_s
            sent = await start_post(self._client, server, ex.endpoint, jsonio.dumps(body), ex.request_id,
                                    self._auth.get("ctx", ()))
            if then is not None:
                try:
                    await then()
                except BaseException:
                    sent.close()  # nobody will read the answer: closing aborts the prefill
                    raise
            raw = await read_answer(sent, deadline, "ctx", timeout_s)
        try:
            answer = parse_ctx_answer(raw)
        except ValueError:
            raise AttemptFailed("ctx answer is not JSON") from None
        check_ctx_answer(answer, num_choices(ex.body), ex.choice_index or 0)
        if pending and self._selfcheck is not None:
            self._check_pending_hits(ex, synced, answer)
        else:
            self._check_hits("ctx", ex, predicted, answer)
        return answer

    def _check_pending_hits(self, ex: Exchange, synced: bool, answer: dict) -> None:
        """The ctx self-check of a request routed on a pending hint (no server held a block at its
        pick: predicted 0 where the index was synced, None where not). The prompt's length is the
        ctx server's own ``usage.prompt_tokens``, so the prompt is not tokenized for it; only an
        answer without that number makes the hint resolve here (and only when it reports a hit:
        without one the self-check counts nothing)."""
        hint = ex.hint
        assert hint is not None
        if reported_hit(answer) is None:
            return
        prompt_tokens = _prompt_tokens(answer) if hint.pending is not None else None
        if prompt_tokens is None:
            prompt_tokens = hint.resolve().num_tokens
        predicted = 0 if synced and prompt_tokens > 0 else None
        self._check_hits("ctx", ex, predicted, answer, prompt_tokens)

    async def _gen_json_attempt(self, ex: Exchange, server: Server, body: bytes) -> Response:
        predicted = self._predict(server, ex.hint) if ex.colocated else None
        with server.track():
            raw = await post_json_raw(self._client, server, ex.endpoint, body, self._settings.request_timeout_s,
                                      "gen", ex.request_id, self._auth.get("gen", ()))
        answer = check_gen_answer(raw)
        if ex.colocated:  # the gen server computed the prompt: its hit is its own
            self._check_hits("gen", ex, predicted, answer)
        return self._json_response(ex, raw)  # relayed as the server wrote it

    async def open_gen_stream(self, ex: Exchange, server: Server, body: bytes, leased: bool) -> GenStream:
        """POST a streaming gen request and wait for its first byte (``leased``: a generation_only
        request, whose KV pull is then done; its time goes to the KV-transfer histogram).

        Raises AttemptFailed / UpstreamRejected as :func:`orchestrator.upstream.open_stream`."""
        predicted = self._predict(server, ex.hint) if ex.colocated else None  # at pick time, before any await
        server.in_flight += 1  # handed to the relay, which drops it when the stream ends
        server.served += 1
        t0 = time.monotonic()
        try:
            stream = await open_stream(self._client, server, ex.endpoint, body, self._settings.request_timeout_s,
                                       "gen", ex.request_id, self._auth.get("gen", ()))
        except BaseException:
            server.in_flight -= 1
            raise
        if leased:
            self._metrics.kv_handoff.observe(time.monotonic() - t0)
            self._metrics.child(self._metrics.routed, "gen", "disaggregated").inc()
        return GenStream(server, stream, predicted)

    def _final_from_ctx(self, ex: Exchange, answer: dict) -> Response:
        for choice in answer.get("choices", []):
            choice.pop("disaggregated_params", None)
        if not ex.stream:
            return self._json_response(ex, answer)
        opts = ex.body.get("stream_options") or {}
        events = answer_to_events(answer, ex.chat, bool(opts.get("include_usage", False)),
                                  bool(opts.get("continuous_usage_stats", False)))
        self._observe_done(ex)
        return EventStream(iterate(events))

    def _json_response(self, ex: Exchange, answer: dict | bytes) -> JSONAnswer:
        self._observe_done(ex)
        return JSONAnswer(answer)

    def _observe_done(self, ex: Exchange) -> None:
        elapsed = time.monotonic() - ex.started_s
        self._metrics.child(self._metrics.ttft, ex.endpoint).observe(elapsed)
        self._metrics.child(self._metrics.e2e, ex.endpoint).observe(elapsed)


def relay_head(ex: Exchange) -> dict | None:
    """The ``id`` and ``created`` (unix seconds) of ``ex``'s chunks when its gen streams may pass
    through as bytes (:meth:`orchestrator.relay.GenRelay._passed`): a client's stream of one choice
    whose text is not parsed here. None otherwise. The id is the disagg request id without its
    ``disagg-`` prefix (per-process random bits and a counter) behind OpenAI's ``cmpl-``/``chatcmpl-``,
    so a stream keeps one id across servers."""
    if not ex.stream or ex.parses or num_choices(ex.body) > 1:
        return None
    return {"id": f"{'chatcmpl' if ex.chat else 'cmpl'}-{ex.disagg_request_id.removeprefix('disagg-')}",
            "created": int(time.time())}


def _prompt_tokens(answer: dict) -> int | None:
    """``usage.prompt_tokens`` of a server's answer (a positive int), else None."""
    usage = answer.get("usage")
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_ctx_answer(answer: dict, n: int = 1, first_index: int = 0) -> None:
    """Raise AttemptFailed unless ``answer`` is a usable ctx answer (final, or with ctx params on
    choice 0): ``n`` choices, indexes ``first_index``.. in order (``first_index``: the choice an
    n = 1 continuation of an n > 1 request continues)."""
    choices = answer.get("choices")
    want = list(range(first_index, first_index + n))
    if (not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices)
            or [c.get("index", 0) for c in choices] != want):
        raise AttemptFailed(f"ctx answer does not hold exactly {n} choice(s), indexes {want[0]}..{want[-1]}")
    choice = choices[0]
    if all_finished(answer):
        return
    params = choice.get("disaggregated_params")
    if not isinstance(params, dict) or not params.get("ctx_request_id"):
        raise AttemptFailed("ctx answer has neither finish_reason nor disaggregated_params.ctx_request_id")


async def run_to_end(relay: "GenRelay | ChoicesRelay", source: GenSource) -> None:
    """A non-stream request's gen phase: run ``relay`` to its end (no client writes); the source's
    lease is abandoned if it did not finish. Raises OrchestratorError 503 with the relay's failure."""
    try:
        failure = await relay.run(None)
    finally:
        if not relay.finished:
            source.abandon()
    if failure is not None:
        raise OrchestratorError(503, f"generation phase failed: {failure}", kind="gen_failed",
                                type_="service_unavailable")
