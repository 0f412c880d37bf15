"""A near-zero-cost OpenAI worker for measuring routers: answers at once, no model.

    python bench/fake_worker.py --port 9001 [--role prefill|decode|both] [--tokenizer-dir DIR]

It speaks what each router in the overhead experiment asks of a worker:

- plain OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (stream or not): ``max_tokens``
  one-word tokens, then a usage chunk; ``--token-delay-ms`` between streamed tokens (default 0);
  without a delay, one write per SSE event (``--stream-writes per-event``, the default) or the
  whole stream and its response head in one write (``--stream-writes one``: the routers then read
  a stream in one piece, and the fake's own system calls stop weighing on the core it shares
  with the load generator);
- pdserve's ``disaggregated_params``: ``context_only`` → a one-token answer with parked-lease
  params (no KV is really parked); ``generation_only`` → the stream (pass-through events when it names
  ``relay_head``, as a pdserve gen server writes them); ``POST /disagg/release``;
- pdserve's ``generation_first`` (``orchestrator.schedule_style``): a ``generation_only`` request
  that names ``ctx_url`` instead of the ctx params really waits, streaming only once the ctx
  worker's ``context_only`` answer for that ``disagg_request_id`` is made. ``--ctx-signal pull``:
  as the real gen server, it POSTs the ctx worker's ``/disagg/lease`` (pdserve.kv_wait), which
  answers as soon as that answer is ready (or at once, if it already was); ``--ctx-signal push``
  (the default): it waits for the ``parked`` line the ctx worker pushes on one long-lived
  subscription (:mod:`fake_ctx_feed`: the same wait at a fraction of the CPU, which the bench's
  workers spend on the core the router's client shares);
- sglang-router's PD mode (requests carrying ``bootstrap_room``): with ``--role prefill`` the
  answer is one token (the router drains it), with ``--role decode`` the full answer;
- ``GET /health``, ``/v1/models``, ``/server_info``, ``/get_server_info``, ``/model_info``,
  ``/get_model_info`` (naming ``--tokenizer-dir``, which sglang-router loads);
- pdserve's ``GET /tokenizer`` (tokenizer.json + chat template of ``--tokenizer-dir``), which the
  orchestrator's ``kv_cache_aware`` router loads to hash prompts;
- pdserve's ``GET /kv_events`` (:mod:`pdserve.kv_events`): a snapshot of no blocks, then a heartbeat
  every second, so the orchestrator's KV indexes of this worker are synced (and stay empty) and
  ``kv_cache_aware`` scores every prompt as it would in front of a real server;
- ``--trace N``: the ``time.monotonic()`` of each step of the last N requests, keyed by their
  ``X-Request-Id`` (``GET /trace``; :class:`StepTrace`), which ``bench/dispatch_trace.py`` lines up
  with the client's own clock (CLOCK_MONOTONIC is one clock for every process of a host).

Raw ASGI on uvicorn (no FastAPI) so the worker costs far less than the routers it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (orchestrator.h1client)
    sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:  # ... and fake_ctx_feed beside this file
    sys.path.insert(0, str(ROOT / "bench"))

from fake_ctx_feed import FEED_PATH, ParkedFeeds, ParkedPublisher  # noqa: E402
from pdserve.protocol import RELAY_LINE  # noqa: E402

MODEL = "fake-model"
WORD = " tok"
KV_HEARTBEAT_S = 1.0   # between /kv_events heartbeats (a real server's default)
MAX_OUTCOMES = 10_000  # ctx role: lease-wait outcomes kept for waits still to come (oldest dropped)
_STEP_NAMES = {"context_only": "ctx", "generation_only": "gen"}  # request_type -> StepTrace step prefix


class StepTrace:
    """When each request reached each step here: ``{request id: {step: time.monotonic() s}}`` for the
    last ``size`` request ids (0: nothing is kept, and :meth:`mark` costs one comparison).

    Steps: ``<phase>_in`` when the app has the request's body parsed (``ctx``, ``gen``, ``plain``,
    ``lease``; stamped with the time its first ASGI call began), ``ctx_out`` / ``lease_out`` / ``plain_out``
    / ``gen_out`` after the last body byte was handed to uvicorn, ``gen_first`` after the first
    streamed event, and on a generation_first gen request ``wait_sent`` (its wait for the ctx
    worker begins: the lease POST is about to be written, or the pushed line awaited) and
    ``wait_back`` (the lease answer, or the pushed line, was read)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._steps: OrderedDict[str, dict[str, float]] = OrderedDict()

    def mark(self, request_id: str | None, step: str, t: float | None = None) -> None:
        if not self.size or request_id is None:
            return
        steps = self._steps.get(request_id)
        if steps is None:
            steps = self._steps[request_id] = {}
            while len(self._steps) > self.size:
                self._steps.popitem(last=False)
        steps[step] = time.monotonic() if t is None else t

    def dump(self) -> dict[str, dict[str, float]]:
        return dict(self._steps)


def _request_id(scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value.decode("latin-1")
    return None


def _usage(n_prompt: int, n: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}


def _prompt_len(body: dict) -> int:
    p = body.get("prompt")
    if isinstance(p, list):
        return len(p)
    if isinstance(p, str):
        return max(1, len(p.split()))
    return sum(max(1, len(str(m.get("content", "")).split())) for m in body.get("messages") or [])


class FakeWorker:
    def __init__(self, role: str, tokenizer_dir: str, token_delay_s: float, trace: int = 0,
                 ctx_signal: str = "push", one_write: bool = False) -> None:
        if ctx_signal not in ("pull", "push"):
            raise ValueError(f"ctx_signal must be pull or push, got {ctx_signal!r}")
        self.role = role
        self.trace = StepTrace(trace)
        self.ctx_signal = ctx_signal
        self.publisher = ParkedPublisher()   # ctx role: subscribers of the pushed "parked" lines
        self._feeds: ParkedFeeds | None = None  # gen role, push: the subscriptions (made in the serving loop)
        self.tokenizer_dir = tokenizer_dir
        self.token_delay_s = token_delay_s
        self.one_write = one_write  # a stream without token delay leaves in one write (else one per event)
        self.requests = 0
        self.bootstrapped = 0  # requests that carried sglang's bootstrap_room
        self.phases: dict[str, int] = {}
        self.waited = 0        # generation_first gen requests that waited on a ctx worker (and got its lease)
        self.waits_answered = 0
        self._outcomes: OrderedDict[str, asyncio.Future] = OrderedDict()  # disagg id -> lease-wait outcome
        self._http = None      # orchestrator.h1client.H1Client for the waits, made in the server's loop

    def info(self) -> dict:
        return {"model_path": self.tokenizer_dir, "tokenizer_path": self.tokenizer_dir, "is_generation": True,
                "served_model_name": MODEL, "role": self.role, "max_context_length": 8192, "vocab_size": 49152,
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "preferred_sampling_params": None,
                "weight_version": "default", "supports_vision": False, "eos_token_ids": [2],
                "bos_token_id": 1, "pad_token_id": 2, "max_req_input_len": 8191,
                "internal_states": [{"last_gen_throughput": 0.0}]}

    def tokenizer_payload(self) -> dict:
        d = Path(self.tokenizer_dir)
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        template = config.get("chat_template")
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        token = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
        return {"tokenizer_json": (d / "tokenizer.json").read_text(), "chat_template": template,
                "bos_token": token(config.get("bos_token")), "eos_token": token(config.get("eos_token")), "model": MODEL}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self._feeds is not None:
                        await self._feeds.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        t_in = time.monotonic()
        path, method = scope["path"], scope["method"]
        if method == "GET":
            if path in ("/health", "/health_generate", "/ping"):
                return await self._json(send, 200, {"status": "ok"})
            if path == "/v1/models":
                return await self._json(send, 200, {"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": 0, "owned_by": "pdserve-bench"}]})
            if path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
                return await self._json(send, 200, self.info())
            if path == "/stats":
                return await self._json(send, 200, {"requests": self.requests, "bootstrapped": self.bootstrapped,
                                                    "phases": self.phases, "waited": self.waited,
                                                    "waits_answered": self.waits_answered})
            if path == "/tokenizer":
                return await self._json(send, 200, self.tokenizer_payload())
            if path == "/trace":
                return await self._json(send, 200, {"steps": self.trace.dump()})
            if path == "/kv_events":
                return await self._kv_events(receive, send)
            if path in ("/get_load", "/v1/loads"):
                return await self._json(send, 200, {"load": 0})
            return await self._json(send, 404, {"error": {"message": f"no route {path}"}})
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/disagg/release" or path == "/flush_cache":
            return await self._json(send, 200, {"released": True})
        if path == FEED_PATH:
            done = [{"disagg_request_id": did, **fut.result()} for did, fut in self._outcomes.items() if fut.done()]
            return await self.publisher.serve(receive, send, done)
        rid = _request_id(scope) if self.trace.size else None
        if path == "/disagg/lease":
            self.trace.mark(rid, "lease_in", t_in)
            await self._json(send, 200, await self._lease_wait(json.loads(raw)))
            return self.trace.mark(rid, "lease_out")
        if path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
            return await self._json(send, 404, {"error": {"message": f"no route {path}"}})
        self.requests += 1
        body = json.loads(raw or b"{}")
        self.bootstrapped += "bootstrap_room" in body
        phase = (body.get("disaggregated_params") or {}).get("request_type", "plain")
        self.phases[phase] = self.phases.get(phase, 0) + 1
        step = _STEP_NAMES.get(phase, phase)
        self.trace.mark(rid, f"{step}_in", t_in)
        await self._complete(send, body, chat=path.endswith("chat/completions"), trace_id=rid)
        self.trace.mark(rid, f"{step}_out")

    async def _kv_events(self, receive, send) -> None:
        """An NDJSON KV event stream with no events: the empty snapshot, then heartbeats until the
        subscriber leaves (the orchestrator's read timeout is 5 s)."""
        from pdserve.kv_events import KVSnapshot, control_line, snapshot_line

        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        await send({"type": "http.response.body", "body": snapshot_line(KVSnapshot("fake", 0, ())),
                    "more_body": True})
        while True:
            try:
                msg = await asyncio.wait_for(receive(), KV_HEARTBEAT_S)
            except TimeoutError:
                await send({"type": "http.response.body", "body": control_line("heartbeat", "fake", 0),
                            "more_body": True})
                continue
            if msg["type"] == "http.disconnect":
                return

    def _outcome(self, disagg_id: str) -> asyncio.Future:
        fut = self._outcomes.get(disagg_id)
        if fut is None:
            fut = self._outcomes[disagg_id] = asyncio.get_running_loop().create_future()
            while len(self._outcomes) > MAX_OUTCOMES:
                self._outcomes.popitem(last=False)
        return fut

    async def _lease_wait(self, body: dict) -> dict:
        """ctx role: the outcome of ``disagg_request_id``'s context request, waiting ``wait_ms`` at most."""
        did = body["disagg_request_id"]
        try:
            async with asyncio.timeout(body["wait_ms"] / 1000.0):  # no task (asyncio.wait_for makes one)
                answer = await asyncio.shield(self._outcome(did))
        except TimeoutError:
            answer = {"state": "timeout", "message": "nothing parked"}
        self._outcomes.pop(did, None)
        self.waits_answered += 1
        return answer

    async def _wait_for_ctx(self, dp: dict, trace_id: str | None) -> bool:
        """gen role, generation_first: wait for the ctx worker's signal (``ctx_signal``); True when it parked.

        Uses the orchestrator's lean pooled HTTP/1.1 client (not httpx, as the real gen server
        does), so that this fake's own cost stays small next to the routers it measures."""
        from orchestrator.h1client import H1Client

        if self._http is None:
            self._http = H1Client(5.0, user_agent="fake-worker")
        self.trace.mark(trace_id, "wait_sent")
        if self.ctx_signal == "push":
            if self._feeds is None:
                self._feeds = ParkedFeeds(self._http)
            try:
                outcome = await self._feeds.wait(dp["ctx_url"], dp["disagg_request_id"], 60.0)
            except (TimeoutError, ConnectionError):
                return False
            self.trace.mark(trace_id, "wait_back")
            self.waited += outcome.get("state") == "parked"
            return outcome.get("state") == "parked"
        body = json.dumps({"disagg_request_id": dp["disagg_request_id"], "wait_ms": 60_000}).encode()
        headers = (("X-Request-Id", trace_id),) if trace_id else ()
        async with asyncio.timeout(65.0):  # the wait (60 s) and its answer; no task of its own
            resp = await self._http.post(dp["ctx_url"], "/disagg/lease", body, headers)
            try:
                raw = await resp.read()
            finally:
                resp.close()
        parked = resp.status == 200 and json.loads(raw).get("state") == "parked"
        self.trace.mark(trace_id, "wait_back")
        self.waited += parked
        return parked

    async def _json(self, send, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _complete(self, send, body: dict, chat: bool, trace_id: str | None = None) -> None:
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        n_prompt = _prompt_len(body)
        stream = bool(body.get("stream"))
        dp = body.get("disaggregated_params") or {}
        rtype = dp.get("request_type")
        if rtype == "context_only" or (self.role == "prefill" and "bootstrap_room" in body):
            n, stream = 1, stream and rtype != "context_only"
        if rtype == "generation_only" and dp.get("ctx_url") and not dp.get("ctx_request_id"):
            if not await self._wait_for_ctx(dp, trace_id):
                return await self._json(send, 504, {"error": {"message": "the ctx worker parked nothing",
                                                              "type": "ctx_wait_timeout", "param": None, "code": 504}})
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        if rtype == "context_only":
            params = {"request_type": "context_only", "disagg_request_id": dp.get("disagg_request_id"),
                      "ctx_request_id": rid, "first_gen_tokens": [1000], "prompt_token_ids": [1] * n_prompt,
                      "kv_endpoint": "fake://none", "kv_block_count": 1, "lease_deadline": time.time() + 30,
                      "kv_layout": {"model": MODEL, "num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                                    "block_size": 16, "dtype": "float32"}}
            choice = {"index": 0, "finish_reason": None, "logprobs": None, "disaggregated_params": params}
            choice.update({"message": {"role": "assistant", "content": WORD}} if chat else {"text": WORD})
            did = params["disagg_request_id"]
            if did:  # a generation_first gen worker may be waiting for this
                fut = self._outcome(did)
                fut.done() or fut.set_result({"state": "parked", "disaggregated_params": params})
            await self._json(send, 200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                         "created": created, "model": MODEL, "choices": [choice],
                                         "usage": _usage(n_prompt, 1)})
            if did and self.publisher.subscribers:  # after the answer, as a pull's answer comes after it
                await self.publisher.publish({"disagg_request_id": did, "state": "parked", "disaggregated_params": params})
            return
        if not stream:
            choice = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": WORD * n}} if chat else {"text": WORD * n})
            return await self._json(send, 200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                                "created": created, "model": MODEL, "choices": [choice],
                                                "usage": _usage(n_prompt, n)})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = dp.get("relay_head")
        if isinstance(head, dict):  # pass-through events, as a pdserve gen server writes them
            rid, created = head["id"], head["created"]
        events = _token_events(rid, obj, created, chat, n, passed=isinstance(head, dict))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": rid, "object": obj, "created": created, "model": MODEL, "choices": [],
                     "usage": _usage(n_prompt, n)}
            events.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        if self.token_delay_s <= 0 and self.one_write:  # all at once: one write (--stream-writes one)
            await send({"type": "http.response.body", "body": b"".join(events), "more_body": False})
            self.trace.mark(trace_id, "gen_first")
            return
        for i, event in enumerate(events):
            await send({"type": "http.response.body", "body": event, "more_body": i < len(events) - 1})
            if i == 0:
                self.trace.mark(trace_id, "gen_first")
            if self.token_delay_s > 0 and i < n - 1:
                await asyncio.sleep(self.token_delay_s)


def _token_events(rid: str, obj: str, created: int, chat: bool, n: int, passed: bool = False) -> list[bytes]:
    """The ``n`` SSE events (``data: {...}`` and a blank line each) of a streamed answer of ``n`` tokens;
    the middle ones are the same bytes, encoded once (the fake's cost per token stays far below a
    router's). ``passed``: pass-through events (``disaggregated_params.relay_head``): each after its
    record line (pdserve.protocol.RELAY_LINE), no role."""
    if passed:
        middle = encode_chunk(rid, obj, created, chat, None, role=False)
        return [RELAY_LINE + b"[%d,%d,[%d],%s]\n" % (4 * i, 4 * i + 4, 1000 + i, b'"length"' if i == n - 1 else b"null")
                + (encode_chunk(rid, obj, created, chat, "length", role=False) if i == n - 1 else middle)
                for i in range(n)]

    def encode(i: int) -> bytes:
        return encode_chunk(rid, obj, created, chat, "length" if i == n - 1 else None, role=i == 0)

    if n <= 3:
        return [encode(i) for i in range(n)]
    middle = encode(1)
    return [encode(0), *([middle] * (n - 2)), encode(n - 1)]


def encode_chunk(rid: str, obj: str, created: int, chat: bool, finish: str | None, role: bool) -> bytes:
    """One ``data:`` event of one token (WORD)."""
    if chat:
        delta = {"role": "assistant", "content": WORD} if role else {"content": WORD}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": WORD, "finish_reason": finish, "logprobs": None}
    event = {"id": rid, "object": obj, "created": created, "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--tokenizer-dir", default="", help="a local HF tokenizer directory (named in /model_info)")
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="keep the step times of the last N requests (GET /trace); 0 = off")
    p.add_argument("--ctx-signal", choices=("pull", "push"), default="push",
                   help="how a generation_first gen request waits for the ctx worker (module docstring)")
    p.add_argument("--stream-writes", choices=("per-event", "one"), default="per-event",
                   help="a stream without token delay: one write per SSE event (default), or the whole "
                        "stream with its response head in one write")
    args = p.parse_args(argv)
    one = args.stream_writes == "one"
    app = FakeWorker(args.role, args.tokenizer_dir, args.token_delay_ms / 1000.0, args.trace, args.ctx_signal,
                     one_write=one)
    http: object = "auto"
    if one:  # the response head leaves with the first body bytes, as the orchestrator sends its own
        from orchestrator.http_protocol import HeadWithBodyProtocol

        http = HeadWithBodyProtocol
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on",
                http=http)


if __name__ == "__main__":
    main()
