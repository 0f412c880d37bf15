"""The OpenAI HTTP server of one pool member (ctx or gen): FastAPI routes over an EngineClient.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream and non-stream),
``GET /v1/models``, ``GET /health``, ``GET /server_info``, ``GET /metrics``, plus whatever the role
adds (``POST /disagg/release`` on ctx servers). Every error is an OpenAI-style body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import RequestValidationError
from engine.kv_connector import HANDED_BACK
from engine.request import RequestOutput
from engine.structured_output import GrammarCompiler
from executor.disconnect import unless_client_leaves
from executor.engine_client import EngineClient, EngineDeadError, EngineNotServingError, EngineState
from executor.metrics import ServerMetrics
from executor.openai_adapter import (
    BadRequest,
    Choices,
    ChunkEncoder,
    check_length,
    engine_request,
    Shape,
    completion_logprobs_of,
    full_response,
    prompt_token_ids,
    request_tool_use,
    response_shape,
    sampling_params,
)
from pdserve.output_parser import ParsedDelta, output_parser
from executor.logprobs_format import chat_logprobs, to_wire
from executor.phases import PhaseAnswer, PhaseError, PhaseHandler
from executor.structured_check import check_structured_output
from pdserve import request_id
from pdserve.api_keys import ApiKeyGuard, load_api_key
from pdserve.asgi_guard import ErrorBoundary
from pdserve.config import ServerConfig
from pdserve.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    HANDED_BACK_EVENT,
    MOVED_CHOICES_KEY,
    DisaggregatedParams,
    KVLayoutModel,
    ModelCard,
    ModelList,
    RelayHead,
    error_body,
    now_s,
    sse_event,
)
from pdserve.request_body import BodyError, decode_json, read_limited, validate_request, validation_message

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as an OpenAI error body with HTTP ``status``; ``code`` is the body's ``code``
    (OpenAI's string, e.g. ``model_not_found``), the status when None."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 close_connection: bool = False, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code
        self.close_connection = close_connection  # a 413 left the body unread

    def response(self) -> JSONResponse:
        headers = {"connection": "close"} if self.close_connection else None
        return JSONResponse(error_body(self.message, self.type, self.code or self.status, self.param),
                            status_code=self.status,
                            headers=headers)


@dataclass
class ServerState:
    """Everything the routes need; built by ``executor.server_main`` and owned by the app."""

    config: ServerConfig
    client: EngineClient
    handlers: dict[str, PhaseHandler]
    metrics: ServerMetrics
    kv_layout: KVLayoutModel
    kv_backend: str
    vocab_size: int
    routers: list[APIRouter] = field(default_factory=list)
    frontend_id: int = 0  # which frontend of the server this process is (x-pdserve-frontend header)
    kv_layouts: list[KVLayoutModel] = field(default_factory=list)  # every TP rank's layout (rank order)
    on_startup: list[Callable[[], None]] = field(default_factory=list)
    on_shutdown: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)
    grammars: GrammarCompiler | None = None  # structured output: specs compiled here first (400s)


def map_error(err: BaseException) -> ApiError:
    """Translate engine/phase failures into HTTP errors (status + OpenAI error type)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, EngineDeadError):
        return ApiError(503, str(err), "engine_dead")
    if isinstance(err, EngineNotServingError):
        return ApiError(503, str(err), "service_unavailable")
    if isinstance(err, BadRequest):
        return ApiError(400, str(err), param=err.param)
    if isinstance(err, PhaseError):
        return ApiError(err.status, str(err), err.kind)
    if isinstance(err, (RequestValidationError, ValueError)):
        return ApiError(400, str(err))
    log.exception("internal error", exc_info=err)
    return ApiError(500, f"internal error: {type(err).__name__}: {err}", "internal_error")


async def read_request(request: Request, model: type[BaseModel]) -> BaseModel:
    """Read, decode and validate a client body by the shared rules of :mod:`pdserve.request_body`.

    Raises ApiError 413 (over ``MAX_BODY_BYTES``; the connection is then closed), 400 (not strict
    JSON, not an object, too deep) or 422 (schema; ``param`` names the field).
    """
    try:
        return validate_request(decode_json(await read_limited(request)), model)
    except BodyError as err:
        raise ApiError(err.status, err.message, param=err.param, close_connection=err.close_connection) from None


class FrontendHeader:
    """Pure ASGI middleware adding ``x-pdserve-frontend: <id>`` to every response (streams included),
    and echoing the caller's ``X-Request-Id`` (the orchestrator's request id), which log lines
    written for the request carry too (:mod:`pdserve.request_id`)."""

    def __init__(self, app, frontend_id: int) -> None:
        self.app, self.value = app, str(frontend_id).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id.from_scope_headers(scope["headers"])
        extra = [(b"x-pdserve-frontend", self.value)] + ([(request_id.HEADER, rid.encode())] if rid else [])

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        token = request_id.current.set(rid)
        try:
            await self.app(scope, receive, send_with_header)
        finally:
            request_id.current.reset(token)


def create_server_app(state: ServerState) -> FastAPI:
    """The FastAPI app of one server. Its lifespan runs ``state.on_shutdown`` at exit."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for start in state.on_startup:
            start()
        yield
        for stop in reversed(state.on_shutdown):
            result = stop()
            if asyncio.iscoroutine(result):
                await result

    app = FastAPI(title=f"pdserve {state.config.role} server", lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app)
    app.add_middleware(ApiKeyGuard, key=load_api_key(state.config.api_key_env))  # raises MissingApiKey
    app.add_middleware(ErrorBoundary, name=f"{state.config.role} server")
    app.add_middleware(FrontendHeader, frontend_id=state.frontend_id)  # outermost: on error bodies too
    request_id.install_log_filter(None)  # log lines written for a request start with its id

    _add_info_routes(app, state)
    for router in state.routers:
        app.include_router(router)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, state, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, state, chat=True)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return ApiError(err.status_code, str(err.detail), "not_found" if err.status_code == 404 else "http_error").response()

    @app.exception_handler(FastAPIValidationError)
    async def _validation_error(_: Request, err: FastAPIValidationError) -> JSONResponse:
        message, param = validation_message(list(err.errors()))
        return ApiError(422, message, param=param).response()


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    cfg = state.config

    @app.get("/health")
    async def health() -> JSONResponse:
        client = state.client
        if client.state == EngineState.SERVING:
            return JSONResponse({"status": "ok", "role": cfg.role})
        reason = client.dead_reason if client.state == EngineState.DEAD else f"engine is {client.state.value}"
        return ApiError(503, reason or "unavailable", "service_unavailable").response()

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=cfg.model.name, created=now_s(), max_model_len=state.client.max_model_len)])

    @app.get("/server_info")
    async def server_info() -> dict:
        try:
            stats = await state.client.fresh_stats()
        except (TimeoutError, EngineDeadError):
            stats = {**state.client.stats(), "stale": True}
        return {"role": cfg.role, "index": cfg.index, "model": cfg.model.name, "state": state.client.state.value,
                "kv_layout": state.kv_layout.model_dump(), "kv_backend": state.kv_backend,
                "kv_layouts": [layout.model_dump() for layout in state.kv_layouts or [state.kv_layout]],
                "max_model_len": state.client.max_model_len, **stats}

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await state.client.fresh_stats()
        except (TimeoutError, EngineDeadError):
            stats = state.client.stats()  # the snapshot rank 0 pushes every 0.25 s while it changes
        state.metrics.kv_free_blocks.set(stats["free_blocks"])
        state.metrics.kv_total_blocks.set(stats["total_blocks"])
        state.metrics.requests_waiting.set(stats.get("waiting_requests", 0))
        state.metrics.requests_running.set(stats.get("scheduled_requests", 0))
        collector = getattr(state.metrics, "role_stats", None)
        if collector is not None:
            collector.snapshot = stats
        try:
            return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        finally:
            if collector is not None:
                collector.snapshot = None


async def _serve(request: Request, state: ServerState, chat: bool) -> Response:
    body = await read_request(request, ChatCompletionRequest if chat else CompletionRequest)
    cfg = state.config
    if body.model != cfg.model.name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{cfg.model.name}`",
                       param="model", code="model_not_found")
    disagg = body.disaggregated_params
    rtype = disagg.request_type if disagg else "context_and_generation"
    handler = state.handlers.get(rtype)
    if handler is None:
        raise ApiError(400, f"this {cfg.role} server does not run {rtype} requests", param="disaggregated_params")
    if rtype == "context_only" and body.stream:
        raise ApiError(400, "context_only requests cannot stream", param="stream")
    if disagg is not None and disagg.movable and not body.stream:
        raise ApiError(400, "only a streamed request can be movable (its stream ends with the moved event)",
                       param="disaggregated_params")
    if disagg is not None and disagg.choice_index and body.n > 1:
        raise ApiError(400, "choice_index continues one choice: it needs n = 1", param="n")
    try:
        if rtype == "generation_only" and not disagg.awaits_ctx:
            prompt = list(disagg.prompt_token_ids)  # generation_first: tokenized here, checked against the ctx's
        else:
            prompt = prompt_token_ids(body, state.client.tokenizer, state.vocab_size)
        check_length(len(prompt), state.client.max_model_len, "messages" if chat else "prompt")
        tools = request_tool_use(body)
        params = sampling_params(body, tools)
        if state.grammars is not None:
            check_structured_output(state.grammars, body, params)
    except BadRequest as err:
        raise map_error(err) from None
    rid = f"{'ctx' if rtype == 'context_only' else 'req'}-{uuid.uuid4().hex}"
    ereq = engine_request(rid, prompt, params, disagg, body.cache_salt, body.n)
    answer = PhaseAnswer()
    shape = response_shape(body, prompt, state.client.tokenizer)
    if chat and not (disagg and disagg.raw_output):  # else the caller parses the text it assembles
        parsers = {i: output_parser(tools, cfg.model.tool_call_parser, cfg.model.reasoning_parser)
                   for i in choice_indexes(body.n, disagg)}  # one per choice: each holds its own parse state
        shape.parsers = {i: p for i, p in parsers.items() if p is not None}
    run = _Run(state, rtype, chat, body.model, handler(ereq, disagg, answer), shape)
    first = await run.first_unless_disconnected(request)
    if first is None:
        return Response(status_code=499)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if disagg is not None and disagg.relay_head is not None and passes_through(body, shape):
            events = run.relay_sse(first, include_usage, disagg.relay_head, answer)
        else:
            events = run.sse(first, include_usage, bool(disagg and disagg.stream_token_ids), answer)
        return StreamingResponse(events, media_type="text/event-stream")
    return await run.collect(first, request, answer)


def passes_through(body: ChatCompletionRequest | CompletionRequest, shape: Shape) -> bool:
    """Whether a stream asked for ``relay_head`` gets pass-through events (:meth:`_Run.relay_sse`):
    one choice whose text goes out as is (no logprobs, echo, per-chunk usage or parser here)."""
    return (body.n == 1 and not shape.parsers and shape.logprobs is None and shape.echo is None
            and not shape.continuous_usage)


def choice_indexes(n: int, disagg: DisaggregatedParams | None) -> range:
    """The choice indexes a request's outputs carry: 0..n-1, or its ``choice_index`` alone (n = 1)."""
    i = (disagg.choice_index or 0) if disagg is not None else 0
    return range(i, i + 1) if i else range(n)


class _Run:
    """One request in flight: its outputs, timing metrics and response shaping."""

    def __init__(self, state: ServerState, rtype: str, chat: bool, model: str,
                 outputs: AsyncIterator[RequestOutput], shape: Shape | None = None) -> None:
        self.state, self.rtype, self.chat, self.model, self.outputs = state, rtype, chat, model, outputs
        self.shape = shape or Shape()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = now_s()
        self.t_submit = time.perf_counter()
        self.t_last: float | None = None
        self.choices = Choices()  # n > 1: one running total per choice index

    async def next(self) -> RequestOutput | None:
        """The next output, None at the end. Errors are mapped to :class:`ApiError`."""
        try:
            out = await self.outputs.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as err:  # noqa: BLE001 - every failure becomes an explicit HTTP error
            api = map_error(err)
            self.state.metrics.errors.labels(kind=api.type).inc()
            self.state.metrics.requests.labels(request_type=self.rtype, outcome="error").inc()
            raise api from None
        self._observe(out)
        return out

    async def first(self) -> RequestOutput:
        out = await self.next()
        if out is None:
            raise ApiError(500, "the engine finished the request without any output", "internal_error")
        return out

    def _observe(self, out: RequestOutput) -> None:
        m, now = self.state.metrics, time.perf_counter()
        if out.queue_time_s is not None:
            m.queue_time.labels(request_type=self.rtype).observe(out.queue_time_s)
        if out.new_token_ids:
            if self.t_last is None:
                m.ttft.labels(request_type=self.rtype).observe(now - self.t_submit)
            else:
                m.tpot.labels(request_type=self.rtype).observe((now - self.t_last) / len(out.new_token_ids))
            self.t_last = now
        self.choices.add(out)
        if out.finished:
            m.e2e.labels(request_type=self.rtype).observe(now - self.t_submit)
            m.requests.labels(request_type=self.rtype, outcome=out.finish_reason or "handed_off").inc()
            if out.finish_reason != "moved":  # a moved request's tokens are counted by its target
                m.prompt_tokens.inc(out.num_prompt_tokens)
                m.generation_tokens.inc(sum(a.num_output_tokens for a in self.choices.ordered()))

    async def first_unless_disconnected(self, request: Request) -> RequestOutput | None:
        """The first output, or None (request aborted) if the client left before it came — on a ctx
        server the first output is the whole prefill, on a gen server it waits for the KV pull."""
        task = asyncio.create_task(self.first())
        try:
            if await unless_client_leaves(task, request):
                log.info("client disconnected before the first output; aborted %s", self.id)
                return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await self.outputs.aclose()  # the handler's cleanup aborts the engine request

    async def collect(self, first: RequestOutput, request: Request, answer: PhaseAnswer) -> Response:
        """Non-streaming answer; aborts the request if the client disconnects meanwhile."""
        async def drain() -> None:
            out = first
            while out is not None and not out.finished:
                out = await self.next()

        task = asyncio.create_task(drain())
        try:
            if await unless_client_leaves(task, request):
                log.info("client disconnected; aborted %s", self.id)
                return Response(status_code=499)
            task.result()
        finally:
            if not task.done():
                task.cancel()
                # Let the cancelled drain leave the generator before closing it (closing a running
                # async generator raises); its own cleanup aborts the request.
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.outputs.aclose()
        params = answer.disaggregated_params
        if params is not None and self.shape.logprobs is not None:  # the gen server reports them
            accs = self.choices.ordered()  # n > 1: one first token (and its logprobs) per choice, in order
            prompt_lp = accs[0].prompt_logprobs
            params = params.model_copy(update={
                "first_gen_logprobs": to_wire([lp for a in accs for lp in a.logprobs]),
                "prompt_logprobs": None if prompt_lp is None else to_wire(prompt_lp)})
        body = full_response(self.chat, self.id, self.created, self.model, self.choices, params, self.shape)
        data = body.model_dump(mode="json")
        if answer.disaggregated_params is None:  # the extension field appears only on ctx answers
            for choice in data["choices"]:
                choice.pop("disaggregated_params", None)
        else:
            for choice in data["choices"][1:]:
                choice.pop("disaggregated_params", None)
        return JSONResponse(data)

    def sse(self, first: RequestOutput, include_usage: bool, token_ids: bool = False,
            answer: PhaseAnswer | None = None) -> AsyncIterator[bytes]:
        """Server-sent events; an error after the first byte becomes an error event, then [DONE].

        ``token_ids``: every output with new tokens becomes a chunk (also one whose text is held
        back) carrying them in ``choices[0].token_ids``, so the orchestrator knows each token.
        A request moved off this draining server (finish reason ``moved``) ends with one event
        ``{"moved": disaggregated_params}`` (``answer.moved``: its lease here, token ids so far) and
        ``[DONE]``: no finish chunk, no usage, and no text held back here (the target sends it). A
        movable n > 1 request moved choice by choice ends with ``{"moved": {"choices": [params, ...]}}``
        (pdserve.protocol.MOVED_CHOICES_KEY: one lease per unfinished choice, ``answer.moved_choices``);
        one handed back by the drain (a choice could not be parked: finish reason ``handed_back``)
        ends with ``{"moved": {"handed_back": true}}`` (pdserve.protocol.HANDED_BACK_EVENT): no KV
        is parked; the orchestrator continues each choice by prefilling again."""
        enc = ChunkEncoder(self.chat, self.id, self.created, self.model)
        return self._framed(self._chunks(enc, first, token_ids, answer), enc, include_usage)

    def relay_sse(self, first: RequestOutput, include_usage: bool, head: RelayHead,
                  answer: PhaseAnswer | None = None) -> AsyncIterator[bytes]:
        """:meth:`sse` as pass-through events (``disaggregated_params.relay_head``, one choice): each
        output with text, token ids or a finish reason becomes :meth:`ChunkEncoder.relay_event` (the
        chunk as the client gets it: ``head``'s id and created, no role), its record holding the text's
        character offsets in the output text; the usage chunk, a ``moved`` event and an error event
        are written as :meth:`sse` writes them, without a record."""
        enc = ChunkEncoder(self.chat, head.id, head.created, self.model)
        return self._framed(self._relay_chunks(enc, first, answer), enc, include_usage)

    async def _framed(self, chunks: AsyncGenerator[bytes, None], enc: ChunkEncoder,
                      include_usage: bool) -> AsyncIterator[bytes]:
        """``chunks``, then the usage chunk (``include_usage``) and ``[DONE]``; ``chunks`` that end
        with their own ``[DONE]`` (a moved or handed-back stream) end the stream there; an
        :class:`ApiError` becomes an error event. The engine outputs are closed on every way out."""
        try:
            async for event in chunks:
                yield event
                if event is SSE_DONE:
                    return
            if include_usage:
                yield enc.usage_event(self.choices.usage())
        except ApiError as err:
            yield sse_event(error_body(err.message, err.type, err.code or err.status))
        finally:
            await chunks.aclose()  # suspended at a yield when the stream ends early (moved, client gone)
            await self.outputs.aclose()
        yield SSE_DONE

    async def _chunks(self, enc: ChunkEncoder, first: RequestOutput, token_ids: bool,
                      answer: PhaseAnswer | None) -> AsyncGenerator[bytes, None]:
        """:meth:`sse`'s chunks, one per output that says something (see there)."""
        shape, offsets = self.shape, {}  # choice index -> completions text offset (its first chunk: absent)
        out: RequestOutput | None = first
        while out is not None:
            if out.finish_reason == "moved":  # n > 1: one moved output per choice, the last one finished
                if out.finished:
                    yield self._moved_event(answer)
                    yield SSE_DONE
                    return
                out = await self.next()
                continue
            if out.finish_reason == HANDED_BACK:  # n > 1 on a move_kv drain: each choice goes on elsewhere
                if out.finished:
                    yield sse_event(HANDED_BACK_EVENT)
                    yield SSE_DONE
                    return
                out = await self.next()
                continue
            is_first = out.index not in offsets
            parsed = self._parsed(out)
            if ((parsed if parsed is not None else out.new_text) or out.finished or out.finish_reason is not None
                    or is_first or (token_ids and out.new_token_ids)
                    or (shape.logprobs is not None and out.new_logprobs)):
                text = (shape.echo or "") + out.new_text if is_first else out.new_text
                lp, offsets[out.index] = self._chunk_logprobs(out, is_first, offsets.get(out.index, 0))
                usage = self.choices.usage() if shape.continuous_usage else None
                finish = out.finish_reason  # n > 1: this choice's, also before the request's last output
                if parsed is not None and finish is not None:
                    finish = shape.parser_of(out.index).finish_reason(finish)
                yield enc.event(text, finish, role=is_first, logprobs=lp, usage=usage,
                                token_ids=list(out.new_token_ids) if token_ids else None, index=out.index,
                                delta=None if parsed is None else parsed.to_openai())
            if out.finished:
                return
            out = await self.next()

    async def _relay_chunks(self, enc: ChunkEncoder, first: RequestOutput,
                            answer: PhaseAnswer | None) -> AsyncGenerator[bytes, None]:
        """:meth:`relay_sse`'s events (see there)."""
        chars = 0  # characters of output text before the next output's
        out: RequestOutput | None = first
        while out is not None:
            if out.finish_reason == "moved":
                if out.finished:
                    yield self._moved_event(answer)
                    yield SSE_DONE
                    return
            elif out.new_text or out.new_token_ids or out.finish_reason is not None or out.finished:
                yield enc.relay_event(out.new_text, out.finish_reason, chars, list(out.new_token_ids))
                chars += len(out.new_text)
            if out.finished:
                return
            out = await self.next()

    @staticmethod
    def _moved_event(answer: PhaseAnswer | None) -> bytes:
        if answer is not None and answer.moved_choices:  # n > 1: one lease per moved choice
            return sse_event({"moved": {MOVED_CHOICES_KEY: [p.model_dump(mode="json", exclude_none=True)
                                                            for p in answer.moved_choices]}})
        if answer is None or answer.moved is None:  # the role failed the stream instead (never both)
            return sse_event(error_body("the request was moved without its KV parameters", "internal_error", 500))
        return sse_event({"moved": answer.moved.model_dump(mode="json", exclude_none=True)})

    def _parsed(self, out: RequestOutput) -> ParsedDelta | None:
        """The output's text read by its choice's parser (flushed at the choice's last output); None
        without one."""
        parser = self.shape.parser_of(out.index)
        if parser is None or not self.chat:
            return None
        parsed = parser.feed(out.new_text)
        return parsed + parser.finish() if out.finished or out.finish_reason is not None else parsed

    def _chunk_logprobs(self, out: RequestOutput, is_first: bool, offset: int) -> tuple[dict | None, int]:
        """The logprobs object of one streamed chunk and the completions text offset after it."""
        if self.shape.logprobs is None:
            return None, offset
        entries = out.new_logprobs or []
        if self.chat:
            return chat_logprobs(entries, self.shape.namer), offset
        prompt_lp = self.choices.by_index[out.index].prompt_logprobs if is_first else None
        return completion_logprobs_of(self.shape, prompt_lp, entries, offset)
