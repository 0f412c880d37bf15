"""Fake ctx/gen servers speaking the pdserve server protocol with canned tokens (no engine).

Token ``i`` of every answer is ``TOKENS[i % len(TOKENS)]`` (or of ``Behavior.tokens``); the ctx server samples token 0 and the
gen server streams tokens 0..max_tokens-1 (token 0 = ``first_gen_tokens``, sent exactly once; a
migrated stream's gen request lists tokens 0..k-1 there, and the gen stream still starts at token 0,
as a real gen server's does), with token id ``i`` in ``token_ids`` when asked.
A gen request with ``relay_head`` gets pass-through events (:data:`pdserve.protocol.RELAY_LINE` records), as
a pdserve server streams them, unless ``Behavior.pass_through`` is off.
A :class:`Behavior` injects failures; a :class:`Record` keeps what each server saw.

generation_first: the fake ctx server answers ``POST /disagg/lease`` (``pdserve.kv_wait``) once its
context request for that ``disagg_request_id`` has been answered (or at once if it was); a fake
gen server given ``ctx_url`` really waits on it before it streams.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.protocol import RELAY_LINE, SSE_DONE, error_body, sse_event

TOKENS = ["Hello", ",", " world", "!", " How", " are", " you", "?"]
MODEL = "fake-model"
PROMPT_TOKENS = [1, 2, 3]
REJECT_MARKER = "TOO_LONG"  # a prompt containing it gets a 400 from the ctx server
KV_LAYOUT = {"model": MODEL, "num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "block_size": 16, "dtype": "float32",
             "tp_rank": 0, "tp_size": 1}


def text_of(n: int, tokens: list[str] | None = None) -> str:
    tokens = tokens or TOKENS
    return "".join(tokens[i % len(tokens)] for i in range(n))


@dataclass
class Behavior:
    """Failure injection. ``fail_status`` applies to the next ``fail_times`` completion requests."""

    fail_status: int | None = None
    fail_times: int = 10**9
    health_status: int = 200
    break_after_chunks: int | None = None  # gen stream: drop the connection after N chunks
    break_times: int = 10**9               # ... in this many streams (then stream normally)
    dead_after_chunks: int | None = None   # gen stream: an in-band engine_dead error event after N chunks
    moved_after_chunks: int | None = None  # gen stream (movable): a drain's moved event after N chunks (once)
    chunk_delay_s: float = 0.0
    no_done: bool = False                  # gen stream: end cleanly but without [DONE]
    answer_delay_s: float = 0.0            # gen: think this long before answering (watching for a disconnect)
    kv_layout: dict | None = field(default_factory=lambda: dict(KV_LAYOUT))  # None: /server_info answers 404
    max_model_len: int = 2048              # what /server_info reports
    reset_status: int = 200                # POST /reset_prefix_cache answers this
    ctx_wait_ms: int = 5000                # gen, generation_first: how long it waits on the ctx server
    ctx_delay_s: float = 0.0               # ctx: think this long before answering (a slow prefill)
    # ctx: answer only once a gen server's lease wait for the request timed out (then ctx_delay_s):
    # the order a test needs, whatever the load (a fixed delay raced the gen side's slow wait)
    ctx_answer_after_wait_timeout: bool = False
    tokens: list[str] | None = None        # the token texts answers are made of (None: TOKENS)
    finish_reason: str = "length"          # what an answer that reaches max_tokens ends with
    pass_through: bool = True              # gen stream: honour relay_head as a pdserve server does (False: ignore it)


@dataclass
class Record:
    bodies: list[dict] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)  # X-Request-Id of each completion request
    releases: list[str] = field(default_factory=list)
    leases: set[str] = field(default_factory=set)
    aborted_streams: int = 0
    aborted_requests: int = 0              # non-stream requests whose client left before the answer
    finished_streams: int = 0
    prefix_resets: list[str | None] = field(default_factory=list)  # the Authorization header of each
    answered_at: list[float] = field(default_factory=list)  # time.monotonic() when each gen answer began
    sources: list[str] = field(default_factory=list)  # gen, generation_first: ctx_request_id each wait returned
    arrived_s: list[float] = field(default_factory=list)  # time.monotonic() when each completion request came


def _max_tokens(body: dict, chat: bool) -> int:
    if chat:
        return body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return body.get("max_tokens") or 16


def _usage(n: int) -> dict:
    return {"prompt_tokens": len(PROMPT_TOKENS), "completion_tokens": n, "total_tokens": len(PROMPT_TOKENS) + n}


def _answer(chat: bool, text: str, finish: str | None, n: int, dp: dict | None) -> dict:
    head = {"id": f"cmpl-{uuid.uuid4().hex[:8]}", "created": int(time.time()), "model": MODEL, "usage": _usage(n)}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None, "disaggregated_params": dp}
        return {**head, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None, "disaggregated_params": dp}
    return {**head, "object": "text_completion", "choices": [choice]}


def _chunk(chat: bool, cid: str, text: str | None, finish: str | None, role: bool = False,
           token_ids: list[int] | None = None) -> bytes:
    head = {"id": cid, "created": int(time.time()), "model": MODEL}
    ids = {} if token_ids is None else {"token_ids": token_ids}
    if chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return sse_event({**head, "object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": delta, **ids, "finish_reason": finish}]})
    return sse_event({**head, "object": "text_completion",
                      "choices": [{"index": 0, "text": text or "", **ids, "finish_reason": finish}]})


def _passed_chunk(chat: bool, head: dict, text: str | None, finish: str | None, start: int, ids: list[int]) -> bytes:
    """A pass-through event (relay_head): the record, then the client's chunk (no role, no token_ids)."""
    record = RELAY_LINE + json.dumps([start, start + len(text or ""), ids, finish]).encode() + b"\n"
    if not text and finish is None:
        return record + b"\n"
    if chat:
        delta = {} if text is None else {"content": text}
        return record + sse_event({**head, "object": "chat.completion.chunk", "model": MODEL,
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    return record + sse_event({**head, "object": "text_completion", "model": MODEL,
                               "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]})


def _ctx_answer(beh: Behavior, rec: Record, chat: bool, body: dict) -> tuple[JSONResponse, dict]:
    """The ctx answer and the lease-wait outcome it settles."""
    n = _max_tokens(body, chat)
    if n == 1:
        return JSONResponse(_answer(chat, text_of(1, beh.tokens), beh.finish_reason, 1, None)), {"state": "finished"}
    lease = f"lease-{uuid.uuid4().hex[:8]}"
    rec.leases.add(lease)
    dp = {"request_type": "context_only", "disagg_request_id": body["disaggregated_params"]["disagg_request_id"],
          "ctx_request_id": lease, "first_gen_tokens": [0], "prompt_token_ids": PROMPT_TOKENS,
          "kv_endpoint": "tcp://127.0.0.1:1", "kv_block_count": 1, "lease_deadline": time.time() + 30,
          "kv_layout": KV_LAYOUT}
    return JSONResponse(_answer(chat, text_of(1, beh.tokens), None, 1, dp)), {"state": "parked",
                                                                              "disaggregated_params": dp}


async def _wait_ctx(beh: Behavior, rec: Record, dp: dict) -> JSONResponse | None:
    """generation_first: wait on the ctx server named in ``dp``; None when it parked, else the error answer."""
    import httpx  # here, not at the top: the launcher tests time how fast a fake process starts

    wait = {"disagg_request_id": dp["disagg_request_id"], "wait_ms": beh.ctx_wait_ms}
    async with httpx.AsyncClient(timeout=beh.ctx_wait_ms / 1000 + 5, trust_env=False) as client:
        answer = (await client.post(dp["ctx_url"] + "/disagg/lease", json=wait)).json()
    if answer["state"] == "parked":
        rec.sources.append(answer["disaggregated_params"]["ctx_request_id"])
        return None
    kind, status = {"timeout": ("ctx_wait_timeout", 504), "finished": ("ctx_finished", 409)}.get(
        answer["state"], ("ctx_failed", 502))
    return JSONResponse(error_body(f"ctx wait: {answer['state']}", kind, status), status_code=status)


def _moved_params(dp: dict, n: int) -> dict:
    """What a draining gen server's moved event carries after it streamed output tokens 0..n-1 (the
    fake's token ids are the positions): its own lease of prompt + n - 1 tokens."""
    kv = len(PROMPT_TOKENS) + n - 1
    return {"request_type": "context_only", "ctx_request_id": f"moved-{uuid.uuid4().hex[:8]}",
            "first_gen_tokens": list(range(n)), "prompt_token_ids": PROMPT_TOKENS, "kv_endpoint": "tcp://127.0.0.1:2",
            "kv_layout": KV_LAYOUT, "kv_block_count": -(-kv // KV_LAYOUT["block_size"]), "kv_num_tokens": kv,
            "lease_deadline": time.time() + 30}


def _gen_stream(beh: Behavior, rec: Record, chat: bool, body: dict):
    n = _max_tokens(body, chat)
    include_usage = (body.get("stream_options") or {}).get("include_usage", False)
    dp = body.get("disaggregated_params") or {}
    with_ids = bool(dp.get("stream_token_ids"))
    cid = f"cmpl-{uuid.uuid4().hex[:8]}"
    head = dp.get("relay_head") if beh.pass_through else None

    async def events():
        done, chars = False, 0  # pass-through: characters of output text streamed so far
        try:
            breaks = beh.break_after_chunks is not None and beh.break_times > 0
            if breaks:
                beh.break_times -= 1
            for i in range(n):
                if breaks and i >= beh.break_after_chunks:
                    raise RuntimeError("injected mid-stream failure")
                if beh.moved_after_chunks is not None and i >= beh.moved_after_chunks and dp.get("movable"):
                    beh.moved_after_chunks = None
                    yield sse_event({"moved": _moved_params(dp, i)})
                    yield SSE_DONE
                    done = True
                    return
                if beh.dead_after_chunks is not None and i >= beh.dead_after_chunks:
                    yield sse_event(error_body("engine is dead: injected", "engine_dead", 503))
                    yield SSE_DONE
                    return
                tokens = beh.tokens or TOKENS
                text = tokens[i % len(tokens)]
                if head is not None:
                    yield _passed_chunk(chat, head, text, None, chars, [i])
                    chars += len(text)
                else:
                    yield _chunk(chat, cid, text, None, role=(i == 0), token_ids=[i] if with_ids else None)
                await asyncio.sleep(beh.chunk_delay_s)
            if head is not None:
                yield _passed_chunk(chat, head, None if chat else "", beh.finish_reason, chars, [])
            else:
                yield _chunk(chat, cid, None if chat else "", beh.finish_reason)
            if include_usage:
                yield sse_event({"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                                 "created": 0, "model": MODEL, "choices": [], "usage": _usage(n)})
            if not beh.no_done:
                yield SSE_DONE
            done = True
        finally:
            if done:
                rec.finished_streams += 1
            else:
                rec.aborted_streams += 1

    return StreamingResponse(events(), media_type="text/event-stream")


def make_fake_server(role: str, beh: Behavior, rec: Record) -> FastAPI:
    """A FastAPI app behaving like a ctx (``role="ctx"``) or gen server."""
    app = FastAPI()
    outcomes: dict[str, asyncio.Future] = {}  # ctx: disagg_request_id -> lease-wait outcome (this app's loop)
    timed_out: dict[str, asyncio.Event] = {}  # ctx: disagg_request_id -> a lease wait for it timed out

    def wait_timed_out(disagg_id: str) -> asyncio.Event:
        return timed_out.setdefault(disagg_id, asyncio.Event())

    def outcome(disagg_id: str) -> asyncio.Future:
        return outcomes.setdefault(disagg_id, asyncio.get_running_loop().create_future())

    def settle(body: dict, answer: dict) -> None:
        fut = outcome((body.get("disaggregated_params") or {}).get("disagg_request_id") or "")
        if not fut.done():
            fut.set_result(answer)

    async def complete(request: Request, chat: bool):
        body = await request.json()
        rec.bodies.append(body)
        rec.arrived_s.append(time.monotonic())
        rec.request_ids.append(request.headers.get("x-request-id"))
        if beh.fail_status is not None and beh.fail_times > 0:
            beh.fail_times -= 1
            if role == "ctx":
                settle(body, {"state": "failed", "message": "injected failure"})
            return JSONResponse(error_body("injected failure", "internal_server_error", beh.fail_status),
                                status_code=beh.fail_status)
        if REJECT_MARKER in json.dumps(body):
            if role == "ctx":
                settle(body, {"state": "failed", "message": "rejected"})
            return JSONResponse(error_body("prompt is too long", "invalid_request_error", 400, "messages"), 400)
        dp = body.get("disaggregated_params") or {}
        if role == "ctx":
            assert dp.get("request_type") == "context_only" and body["stream"] is False
            if beh.ctx_answer_after_wait_timeout:
                await asyncio.wait_for(wait_timed_out(dp.get("disagg_request_id") or "").wait(), 30)
            await asyncio.sleep(beh.ctx_delay_s)
            answer, result = _ctx_answer(beh, rec, chat, body)
            settle(body, result)
            return answer
        assert dp.get("request_type") == "generation_only" and (dp.get("ctx_request_id") or dp.get("ctx_url"))
        if not dp.get("ctx_request_id"):
            failed = await _wait_ctx(beh, rec, dp)
            if failed is not None:
                return failed
        deadline = time.monotonic() + beh.answer_delay_s
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                rec.aborted_requests += 1
                return JSONResponse({}, status_code=499)
            await asyncio.sleep(0.02)
        rec.answered_at.append(time.monotonic())
        if body.get("stream"):
            return _gen_stream(beh, rec, chat, body)
        n = _max_tokens(body, chat)
        return JSONResponse(_answer(chat, text_of(n, beh.tokens), beh.finish_reason, n, None))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.get("/health")
    async def health():
        if beh.health_status != 200:
            return JSONResponse(error_body("not ready", "service_unavailable", beh.health_status), beh.health_status)
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info():
        if beh.kv_layout is None:
            return JSONResponse(error_body("Not Found", "not_found", 404), 404)
        return {"role": role, "model": MODEL, "state": "serving", "kv_layout": beh.kv_layout,
                "kv_layouts": [beh.kv_layout], "max_model_len": beh.max_model_len}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        rec.prefix_resets.append(request.headers.get("authorization"))
        if beh.reset_status != 200:
            return JSONResponse(error_body("injected failure", "internal_server_error", beh.reset_status),
                                beh.reset_status)
        return {"freed_blocks": 3}

    @app.post("/disagg/lease")
    async def lease(request: Request):
        body = await request.json()
        try:
            return await asyncio.wait_for(asyncio.shield(outcome(body["disagg_request_id"])), body["wait_ms"] / 1000)
        except TimeoutError:
            wait_timed_out(body["disagg_request_id"]).set()
            return {"state": "timeout"}

    @app.post("/disagg/release")
    async def release(request: Request):
        lease = (await request.json())["ctx_request_id"]
        rec.releases.append(lease)
        released = lease in rec.leases
        rec.leases.discard(lease)
        return {"released": released}

    return app


def bind_socket() -> socket.socket:
    """A listening-ready TCP socket on 127.0.0.1 with a free port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class ThreadServer:
    """Runs an ASGI app with uvicorn in a daemon thread on a pre-bound socket (``http``: uvicorn's
    protocol option; an orchestrator gets the one it serves with in production)."""

    def __init__(self, app, sock: socket.socket | None = None, http: object = "auto") -> None:
        self.sock = sock or bind_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout_s: float = 10.0) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
