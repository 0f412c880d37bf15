"""Where one request's gen streams come from: the first one, retries, and migrations.

* :meth:`GenPhase.first`: the gen stream for the lease the ctx server parked (or, on the
  colocated path, a ``context_and_generation`` stream). A gen server that fails before its first
  byte has not confirmed its KV pull, so the next gen server pulls the same lease
  (``orchestrator.max_retries``). A gen server that reports the KV source failed
  (``kv_transfer_error``) makes the request prefill again on another ctx server.
* :meth:`GenPhase.migrate`: the gen server died mid-decode. The request is prefilled again on a
  ctx server (the same body and seed; the prompt usually hits its prefix cache) and a gen server
  pulls that KV with ``first_gen_tokens`` = every output token generated so far. The gen server
  counts those as output (``max_tokens`` and ``usage`` stay the client's) and samples output
  position ``len(first_gen_tokens)`` next: the sampler's noise is a function of (seed, choice,
  position), so a seeded stream goes on exactly as it would have. A migration first waits
  (``orchestrator.migration_wait_s``) for a ready ctx and gen server.
* :meth:`GenPhase.move`: the gen server drains with ``move_kv`` and parked the request's KV (its
  stream ended with a ``moved`` event). Another gen server gets a ``generation_only`` request for
  that lease: it pulls the blocks (prompt + every output token but the last, ``kv_num_tokens``),
  computes the one token left and samples on with the same seed. Nothing is prefilled again. If
  the target cannot pull (``kv_transfer_error``), the request falls back to a migration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from . import jsonio
from .errors import OrchestratorError
from .lease import KVSourceFailed, Lease
from .progress import Progress
from .relay import GenStream

if TYPE_CHECKING:
    from .disagg import DisaggFlow, Exchange
    from .pools import Server
    from .router import RouteHint

log = logging.getLogger("orchestrator.migration")

_READY_POLL_S = 0.05


class GenPhase:
    """The gen streams of one request (a :class:`orchestrator.relay.GenSource`).

    ``lease``/``params``: the ctx server's parked KV and its answer's ``disaggregated_params``
    (both None on the colocated path). ``token_ids``: ask gen servers for each chunk's token ids
    (needed to migrate). ``want_usage``: ask for the usage chunk (non-stream answers, or the client's
    ``include_usage``).
    """

    def __init__(self, flow: "DisaggFlow", ex: "Exchange", hint: "RouteHint | None", progress: Progress,
                 lease: "Lease | None", params: dict | None, failed_ctx: set[str], token_ids: bool,
                 want_usage: bool, exclude_gen: set[str] | None = None, failures: list[str] | None = None) -> None:
        self._flow, self._ex, self._hint, self._progress = flow, ex, hint, progress
        self._lease, self._params = lease, params
        self._failed_ctx = failed_ctx
        self._token_ids, self._want_usage = token_ids, want_usage
        self.first_stream: GenStream | None = None  # what first() opened
        self._exclude_gen = set(exclude_gen or ())   # gen servers the first stream may not use
        self._failures = failures                    # ... and the attempts already made there (for the error)

    async def first(self) -> GenStream:
        if self._lease is None:
            self.first_stream = await self._open(self._colocated_body(), leased=False)
        else:
            self.first_stream = await self._open_leased()
        return self.first_stream

    async def migrate(self, progress: Progress) -> GenStream:
        settings = self._flow._settings
        deadline = time.monotonic() + settings.migration_wait_s
        for role in ("ctx", "gen"):
            await self._wait_ready(role, deadline)
        return await self._prefill_again()

    async def move(self, progress: Progress, moved: dict, source: "Server") -> GenStream:
        first = moved.get("first_gen_tokens")
        if not moved.get("ctx_request_id") or first != progress.token_ids:
            log.warning("gen server %s moved the request with %s output tokens, the relay has %d; prefilling it "
                        "again instead", source.url, len(first) if isinstance(first, list) else "no",
                        len(progress.token_ids))
            if moved.get("ctx_request_id"):
                self._flow.release_soon(Lease(source.url, moved["ctx_request_id"]), self._ex)
            return await self.migrate(progress)
        self._lease, self._params = Lease(source.url, moved["ctx_request_id"]), moved
        self._exclude_gen = {source.url}  # the draining server admits nothing new
        await self._wait_ready("gen", time.monotonic() + self._flow._settings.migration_wait_s)
        return await self._open_leased()

    def abandon(self) -> None:
        if self._lease is not None:
            self._flow.release_soon(self._lease, self._ex)
            self._lease = None

    async def _wait_ready(self, role: str, deadline: float) -> None:
        pool = self._flow._pools.pool(role)  # type: ignore[arg-type]
        while not pool.ready() and time.monotonic() < deadline:
            await asyncio.sleep(_READY_POLL_S)

    async def _open_leased(self) -> GenStream:
        assert self._lease is not None and self._params is not None
        try:
            return await self._open(self._gen_body(self._params), leased=True)
        except KVSourceFailed as err:
            return await self.kv_source_lost(str(err))
        except BaseException:
            self.abandon()  # no gen server took the lease
            raise

    async def first_elsewhere(self, failed_url: str, failure: str) -> GenStream:
        """The first stream after an attempt on ``failed_url`` (opened by someone else: the
        generation_first dispatch) failed before its first byte, as ``failure`` says: another gen
        server pulls the same lease. Raises OrchestratorError."""
        self._exclude_gen, self._failures = {failed_url}, [failure]
        return await self.first()

    async def kv_source_lost(self, failure: str) -> GenStream:
        """A gen server could not pull the lease (its ctx server lost it): prefill again on another
        ctx server, up to ``max_retries`` ctx servers in all. Raises OrchestratorError."""
        assert self._lease is not None
        self._failed_ctx.add(self._lease.ctx_url)
        self._lease = None  # the ctx server lost it
        if len(self._failed_ctx) > self._flow._settings.max_retries:
            raise OrchestratorError(503, f"generation phase failed: {failure}", kind="gen_failed",
                                    type_="service_unavailable") from None
        log.warning("KV source failed (%s); prefilling the request again on another ctx server", failure)
        self._flow._metrics.retries.labels(pool="ctx").inc()
        return await self._prefill_again()

    async def _open(self, body: bytes, leased: bool) -> GenStream:
        flow, ex = self._flow, self._ex
        exclude, self._exclude_gen = self._exclude_gen, set()  # only the first stream's: a migration may go back
        failures, self._failures = self._failures, None
        _, gs = await flow._with_retries("gen", lambda s: flow.open_gen_stream(ex, s, body, leased), self._hint,
                                         exclude, failures)
        return gs

    async def _prefill_again(self) -> GenStream:
        flow, ex = self._flow, self._ex
        if self._hint is not None:
            self._hint.resolve()  # a later pick: what held no block at the first one may hold some now
        server, answer = await flow._with_retries("ctx", lambda s: flow._context_attempt(ex, s), self._hint,
                                                  set(self._failed_ctx))
        choice = answer["choices"][0]
        if choice.get("finish_reason") is not None:
            raise OrchestratorError(503, "generation phase failed: the ctx server's new prefill finished the request "
                                    f"at its first token ({choice['finish_reason']})", kind="gen_failed",
                                    type_="service_unavailable")
        self._params = choice["disaggregated_params"]
        self._lease = Lease(server.url, self._params["ctx_request_id"])
        return await self._open_leased()

    def _stream_fields(self) -> dict[str, Any]:
        body: dict[str, Any] = {"stream": True}
        if self._want_usage:  # the client's other stream options (continuous_usage_stats) stay
            body["stream_options"] = {**(self._ex.body.get("stream_options") or {}), "include_usage": True}
        return body

    def _gen_body(self, params: dict) -> bytes:
        first = self._progress.token_ids or params.get("first_gen_tokens")
        dp = {**params, "request_type": "generation_only", "disagg_request_id": self._ex.disagg_request_id,
              "first_gen_tokens": first}
        self._request_side(dp)
        if self._ex.relay_head is not None:  # the stream passes through as bytes (orchestrator.relay)
            dp["relay_head"] = self._ex.relay_head
        return jsonio.dumps({**self._ex.body, **self._stream_fields(), "disaggregated_params": dp})

    def _request_side(self, dp: dict[str, Any]) -> None:
        """The request-side fields of a gen request's ``disaggregated_params`` (set on ``dp``)."""
        if self._token_ids:  # the relay knows every token: it can migrate the stream, or move it on a drain
            dp["stream_token_ids"] = dp["movable"] = True  # n > 1: a drain moves each choice (orchestrator.choices_relay)
        if self._ex.parses:  # the relay parses the text it assembles
            dp["raw_output"] = True
        if self._ex.choice_index is not None:  # continues one choice of an n > 1 request (orchestrator.choices)
            dp["choice_index"] = self._ex.choice_index

    def _colocated_body(self) -> bytes:
        body = {**self._ex.body, **self._stream_fields()}
        dp: dict[str, Any] = {"request_type": "context_and_generation"}
        self._request_side(dp)
        if len(dp) > 1:
            body["disaggregated_params"] = dp
        return jsonio.dumps(body)

