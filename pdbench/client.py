"""One OpenAI request, streamed (or not), timed chunk by chunk: :func:`send_request` → RequestRecord."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from .datasets import Sample
from .metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestOptions:
    base_url: str
    model: str
    endpoint: str = "completions"  # key of ENDPOINTS
    stream: bool = True
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)


def build_body(sample: Sample, opts: RequestOptions) -> dict:
    """The JSON body of one request: ``sample.messages`` (or one user message of ``sample.prompt``) on
    the chat endpoint, ``sample.prompt`` on completions. Raises ValueError for token ids on chat."""
    body: dict = {"model": opts.model, "max_tokens": sample.output_len, "temperature": opts.temperature,
                  "stream": opts.stream}
    if opts.stream:
        body["stream_options"] = {"include_usage": True}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat" and sample.messages is not None:
        body["messages"] = sample.messages
    elif opts.endpoint == "chat":
        if not isinstance(sample.prompt, str):
            raise ValueError("the chat endpoint needs text prompts: use --prompt-format text")
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    body.update(opts.extra_body)
    return body


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _cached_tokens(usage: dict) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw[:200].decode(errors="replace")
    return f"HTTP {status}: {msg}"


async def send_request(client: httpx.AsyncClient, sample: Sample, opts: RequestOptions) -> RequestRecord:
    """Send one request; never raises for HTTP or transport errors (they land in ``record.error``)."""
    url = opts.base_url.rstrip("/") + ENDPOINTS[opts.endpoint]
    body = build_body(sample, opts)
    rec = RequestRecord(ok=False, prompt_tokens=sample.prompt_len)
    usage = None
    rec.start = time.perf_counter()
    try:
        if not opts.stream:
            r = await client.post(url, json=body)
            now = time.perf_counter()
            if r.status_code != 200:
                rec.error = _error_text(r.status_code, r.content)
                return rec
            data = r.json()
            rec.chunk_times = [now]
            rec.text = "".join(_choice_text(c) for c in data.get("choices") or [])
            usage = data.get("usage")
        else:
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    rec.error = _error_text(r.status_code, await r.aread())
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(payload)
                    if event.get("error"):
                        err = event["error"]
                        rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        return rec
                    if event.get("usage"):
                        usage = event["usage"]
                    text = "".join(_choice_text(c) for c in event.get("choices") or [])
                    if text:
                        rec.chunk_times.append(now)
                        rec.text += text
    except (httpx.HTTPError, ValueError) as err:
        rec.error = f"{type(err).__name__}: {err}"
        return rec
    if not rec.chunk_times:
        rec.error = "the answer carried no generated text"
        return rec
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        rec.cached_tokens = _cached_tokens(usage)
    if rec.output_tokens <= 0:  # no usage: one token per content chunk
        rec.output_tokens = len(rec.chunk_times)
    rec.ok = True
    return rec


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id at ``base_url/v1/models``. Raises httpx.HTTPError / KeyError."""
    r = await client.get(base_url.rstrip("/") + "/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]
