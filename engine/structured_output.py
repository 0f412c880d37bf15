"""Structured output: a :class:`~pdserve.structured_output.StructuredOutputSpec` compiled by the
grammar library into a per-request matcher that says which tokens may come next.

The library is llguidance (https://github.com/guidance-ai/llguidance, MIT; why this one:
docs/architecture.md, "Structured output"). Its ``LLMatcher`` holds the parse state of one
request: ``consume_token`` advances it, ``unsafe_compute_mask_ptr`` writes the allowed next
tokens as a bitmask (bit ``t % 32`` of int32 word ``t // 32`` is token ``t``), ``is_stopped``
says that only EOS may follow. Its tokenizer view (``LLTokenizer``, built from the HF tokenizer's
``tokenizer.json``) costs a pass over the whole vocabulary, so a :class:`GrammarCompiler` builds it
once, on first use, and every request of the server shares it; compiled grammars are cached by
:meth:`~pdserve.structured_output.StructuredOutputSpec.key`.

No torch here (the HTTP frontends validate specs with it); the masks become tensors in
:mod:`engine.grammar_mask`.
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pdserve.structured_output import StructuredOutputSpec

log = logging.getLogger(__name__)

# JSON as Python's json.dumps writes it ("key": value, item, item): the separators models saw most
# in training, and no free whitespace, so a sampled output cannot run on in blank lines.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHE_SIZE = 256  # compiled grammars kept per compiler (LRU)
BUILD_TIMEOUT_S = 120.0  # the vocabulary view takes ~1-2 s; a build past this is a hung library


class GrammarError(ValueError):
    """The grammar library cannot compile a spec, or a token breaks it; the message says why."""


class TokenRejected(GrammarError):
    """A token given as output so far is not allowed by the grammar at its position."""


def _choice_lark(choices: tuple[str, ...]) -> str:
    """A Lark grammar whose language is exactly ``choices`` (JSON string literals are Lark's)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar (its serialized form) of ``spec``; not yet checked for validity.
    Raises GrammarError when the library refuses the payload outright (a schema that is not JSON)."""
    import llguidance

    m = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            return m.grammar_from_json_schema(spec.json_schema, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.regex)
        if spec.kind == "choice":
            return m.grammar_from_lark(_choice_lark(spec.choices))
        return m.grammar_from_lark(spec.grammar)
    except ValueError as err:
        raise GrammarError(f"{spec.kind}: {err}") from None


def serialized_tokenizer(tokenizer: Any) -> str:
    """The ``tokenizer.json`` text of an ``engine.tokenizer.Tokenizer``, for the library.

    Read from its source (an HF directory's file; a GGUF's metadata, rendered as
    ``engine.gguf_tokenizer`` renders it for the fast tokenizer itself) where it can be, since the
    fallback, the Rust tokenizer's ``to_str()``, holds the GIL for ~0.5-1 s and would stall every
    other thread of the process (an HTTP frontend's event loop, the engine loop)."""
    from engine.model_files import is_gguf

    src = tokenizer.source
    if src is not None and is_gguf(src):
        from engine.gguf_reader import read_gguf
        from engine.gguf_tokenizer import tokenizer_doc

        try:
            doc = tokenizer_doc(read_gguf(src)[0])
        except ValueError:  # not GPT-2 style BPE: transformers converted it; serialize that
            pass
        else:  # iterencode: Python-level chunks (json.dumps is one C call holding the GIL ~0.5 s)
            return "".join(json.JSONEncoder(ensure_ascii=False).iterencode(doc))
    elif src is not None and (Path(src) / "tokenizer.json").is_file():
        return (Path(src) / "tokenizer.json").read_text()
    backend = copy.copy(tokenizer.hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarMatcher:
    """The grammar state of one request (a wrapper of llguidance's ``LLMatcher``).

    eos_token_ids: every id the engine treats as EOS; the library knows one (``library_eos``), so
    the others are consumed as it and share its mask bit (:mod:`engine.grammar_mask`).
    """

    def __init__(self, matcher: Any, library_eos: int, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self.library_eos = library_eos
        self.eos_token_ids = eos_token_ids

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and the matcher stays in its error state) when the
        grammar does not allow it."""
        return bool(self._m.consume_token(self.library_eos if token in self.eos_token_ids else token))

    @property
    def stopped(self) -> bool:
        """The grammar is complete: only EOS may follow (also true in the error state)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The output so far is a whole sentence of the grammar (EOS is allowed now)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher is in its error state ('' when it is not)."""
        return self._m.get_error() or ""

    def fork(self) -> "GrammarMatcher":
        """An independent copy in the same state (a choice of ``n > 1`` forked from one prefill)."""
        return GrammarMatcher(self._m.deep_copy(), self.library_eos, self.eos_token_ids)

    def fill_mask(self, address: int, num_bytes: int) -> None:
        """Write the allowed next tokens as a bitmask into ``num_bytes`` bytes at ``address``
        (one int32 row of ceil(V / 32) words, V = the vocabulary the compiler was built for)."""
        self._m.unsafe_compute_mask_ptr(address, num_bytes)


class GrammarCompiler:
    """Specs → matchers for one tokenizer; thread-safe; one per server process.

    tokenizer: an ``engine.tokenizer.Tokenizer`` (HF fast tokenizer; a GGUF's embedded one is built
    as such by ``engine.gguf_tokenizer``); vocab_size: V, the logits width (tokens the tokenizer
    lacks are never allowed); eos_token_ids: the engine's EOS ids.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = CACHE_SIZE) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._built = threading.Event()
        self._builder: threading.Thread | None = None

    def _build(self) -> None:
        import llguidance

        eos = self._source.hf.eos_token_id
        if eos is None and self.eos_token_ids:
            eos = min(self.eos_token_ids)
        try:  # the constructor releases the GIL; serialized_tokenizer avoids a long hold
            self._tokenizer = llguidance.LLTokenizer(serialized_tokenizer(self._source), n_vocab=self.vocab_size,
                                                     eos_token=eos)
        finally:
            self._built.set()  # a failure too: tokenizer then raises in the caller's thread

    def warm_up(self) -> None:
        """Start building the library's view of the vocabulary in a thread this compiler owns (at
        most one, ever; ~1-2 s for 49,152 tokens on one core): a caller that must not block polls
        :meth:`wait_ready`. :meth:`close` joins it."""
        with self._lock:
            if self._builder is None and not self._built.is_set():
                self._builder = threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True)
                self._builder.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the vocabulary view is built, waiting at most ``timeout_s`` (after :meth:`warm_up`)."""
        return self._built.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Join the warm-up thread (it ends by itself once the build is done)."""
        if self._builder is not None:
            self._builder.join(timeout_s)

    @property
    def tokenizer(self) -> Any:
        """llguidance's ``LLTokenizer`` for this vocabulary, built on first use (or by :meth:`warm_up`),
        then shared. Raises RuntimeError when the build failed or ran past BUILD_TIMEOUT_S."""
        self.warm_up()
        if not self._built.wait(BUILD_TIMEOUT_S):
            raise RuntimeError(f"building the grammar library's tokenizer took over {BUILD_TIMEOUT_S:.0f} s")
        if self._tokenizer is None:
            raise RuntimeError("building the grammar library's tokenizer failed (see the log)")
        return self._tokenizer

    def compile(self, spec: StructuredOutputSpec) -> str:
        """The validated grammar of ``spec`` (cached by ``spec.key()``). Raises GrammarError with
        the library's reason when it cannot compile it. Needs no vocabulary view (no wait for it)."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        import llguidance

        text = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
        if is_error:
            raise GrammarError(f"cannot compile the {spec.kind} constraint: {'; '.join(messages)}")
        with self._lock:
            self._cache[key] = text
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutputSpec, tokens: list[int] = ()) -> GrammarMatcher:
        """A fresh matcher for ``spec`` that has consumed ``tokens`` (the output so far: a gen
        server's first tokens from the ctx server, a migrated stream's output). Raises
        GrammarError when the spec does not compile, TokenRejected when the tokens break it."""
        import llguidance

        tok = self.tokenizer
        m = GrammarMatcher(llguidance.LLMatcher(tok, self.compile(spec), log_level=0), tok.eos_token,
                           self.eos_token_ids)
        if m.error:
            raise GrammarError(f"cannot compile the {spec.kind} constraint: {m.error}")
        for i, t in enumerate(tokens):
            if not m.accept(t):
                raise TokenRejected(f"output token {i} (id {t}) breaks the {spec.kind} constraint: {m.error}")
        return m
