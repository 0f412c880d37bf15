"""Prompt token ids at the orchestrator, without torch or transformers.

The orchestrator needs token ids only for *routing decisions*: the KV block hashes of
``kv_cache_aware`` and the prompt length of conditional disaggregation. The servers still tokenize
every request themselves, so a difference here can only change where a request goes, never what it
answers.

Where the tokenizer comes from: every server answers ``GET /tokenizer`` with its HF
``tokenizer.json`` text, chat template and special tokens (see ``executor/admin_routes.py``). The
first time a request needs token ids, :class:`PromptTokenizer` fetches that from a ready server and
builds a ``tokenizers.Tokenizer`` plus a sandboxed jinja2 chat template, the same way HF renders
chat templates (``trim_blocks``, ``lstrip_blocks``). If no server can answer yet, the request is
routed without token ids (round robin / least loaded, disaggregated) and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdserve.chat_template import hf_messages, template_tools

from .pools import Pool
from .token_cache import TokenCache

log = logging.getLogger("orchestrator.prompt_tokens")

RETRY_AFTER_S = 2.0
INLINE_CHARS = 4096  # prompts up to this many characters are tokenized on the event loop (~0.1 ms)


class LoadedTokenizer:
    """``tokenizers.Tokenizer`` + chat template from a server's ``GET /tokenizer`` answer.

    ``cache``: texts already tokenized (a fresh bounded :class:`TokenCache` when None)."""

    def __init__(self, payload: dict, cache: TokenCache | None = None) -> None:
        import jinja2.sandbox
        from tokenizers import Tokenizer

        self.cache = cache if cache is not None else TokenCache()
        self._tok = Tokenizer.from_str(payload["tokenizer_json"])
        self._special = {k: payload.get(k) or "" for k in ("bos_token", "eos_token")}
        self._template = None
        if payload.get("chat_template"):
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(payload["chat_template"])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added), from the cache when it was seen before.
        The list may be shared with later calls: do not change it."""
        ids = self.cache.get(text)
        if ids is None:
            # encode_batch_fast: the same ids as encode(), without the offsets nobody reads here.
            ids = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
            self.cache.put(text, ids)
        return ids

    def prompt_ids(self, endpoint: str, body: dict) -> list[int]:
        """Token ids of a validated client body (chat template for chat bodies, with its ``tools`` and
        ``chat_template_kwargs``, as the servers render it: :mod:`pdserve.chat_template`); read-only
        (the list may be the body's own token-id prompt or a cached one)."""
        if endpoint.endswith("/chat/completions"):
            if self._template is None:
                raise ValueError("the model has no chat template")
            text = self._template.render(**{**(body.get("chat_template_kwargs") or {}), **self._special},
                                         messages=hf_messages(body["messages"]),
                                         tools=template_tools(body.get("tools")),
                                         add_generation_prompt=body.get("add_generation_prompt", True))
            return self.encode(text)
        prompt = body["prompt"]
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return prompt  # read, never changed, by the routers
        return self.encode(prompt if isinstance(prompt, str) else str(prompt))


def _prompt_chars(body: dict) -> int:
    """About how many characters tokenizing ``body`` handles (token-id prompts count their ids;
    a body of an unexpected shape counts as long: it goes the careful way)."""
    try:
        prompt = body.get("prompt")
        if prompt is not None:
            return len(prompt)
        return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 256
                   for m in body.get("messages") or () if isinstance(m, dict))
    except (TypeError, AttributeError):
        return INLINE_CHARS + 1


def _raise(message: str) -> None:
    raise ValueError(message)


class PromptTokenizer:
    """Lazily fetched tokenizer; :meth:`token_ids` returns ``None`` while none is available."""

    def __init__(self, client: httpx.AsyncClient, pools: list[Pool], timeout_s: float = 5.0) -> None:
        self._client = client
        self._pools = pools
        self._timeout_s = timeout_s
        self._tok: LoadedTokenizer | None = None
        self._lock = asyncio.Lock()
        self._next_try_s = 0.0

    @property
    def loaded(self) -> bool:
        return self._tok is not None

    def inline(self, body: dict) -> bool:
        """Whether :meth:`token_ids_now` can tokenize ``body`` (the tokenizer is loaded and the
        prompt short enough for the event loop: :data:`INLINE_CHARS`)."""
        return self._tok is not None and _prompt_chars(body) <= INLINE_CHARS

    def token_ids_now(self, endpoint: str, body: dict) -> list[int] | None:
        """:meth:`token_ids` without awaiting, for a body :meth:`inline` accepts (None: it cannot
        be tokenized here; the servers report the real error)."""
        assert self._tok is not None, "token_ids_now before the tokenizer loaded (check inline())"
        try:
            return self._tok.prompt_ids(endpoint, body)
        except Exception as err:  # noqa: BLE001 - routing falls back; the server reports real errors
            log.debug("cannot tokenize at the orchestrator: %s", err)
            return None

    async def token_ids(self, endpoint: str, body: dict) -> list[int] | None:
        """Token ids of a validated client body (None: no tokenizer yet, or the prompt cannot be
        tokenized here). A long prompt is tokenized in a worker thread."""
        tok = self._tok or await self._load()
        if tok is None:
            return None
        if _prompt_chars(body) <= INLINE_CHARS:
            return self.token_ids_now(endpoint, body)
        try:
            # A long prompt takes milliseconds to render and tokenize: off the event loop, so the
            # other requests' streams keep flowing meanwhile.
            return await asyncio.to_thread(tok.prompt_ids, endpoint, body)
        except Exception as err:  # noqa: BLE001 - routing falls back; the server reports real errors
            log.debug("cannot tokenize at the orchestrator: %s", err)
            return None

    async def _load(self) -> LoadedTokenizer | None:
        async with self._lock:
            if self._tok is not None or time.monotonic() < self._next_try_s:
                return self._tok
            for server in [s for p in self._pools for s in p.ready()]:
                try:
                    resp = await self._client.get(f"{server.url}/tokenizer", timeout=self._timeout_s)
                    if resp.status_code == 200:
                        self._tok = await asyncio.to_thread(LoadedTokenizer, resp.json())
                        log.info("loaded the tokenizer from %s", server.url)
                        return self._tok
                except Exception as err:  # noqa: BLE001 - try the next server
                    log.warning("GET %s/tokenizer failed: %s", server.url, err)
            self._next_try_s = time.monotonic() + RETRY_AFTER_S
            return None
