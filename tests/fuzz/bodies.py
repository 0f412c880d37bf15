"""Seeded generator of bad (and valid-but-unusual) OpenAI request bodies, shared by every server kind.

``generate(kind, n, seed, model=..., vocab_size=...)`` returns ``n`` :class:`Case` objects for
``kind`` in :data:`KINDS` (``orchestrator``, ``ctx``, ``gen``); the same arguments give the same
bytes. Each case belongs to one class of :data:`CLASSES` (the classes are dealt round-robin, so
every class appears ``n // len(CLASSES)`` times or more) and says what a correct server answers:

- ``REJECT``: a 4xx with an OpenAI error body (the body is invalid for every server kind);
- ``ACCEPT``: a 200 answer (a valid body that common clients send; refusing it is over-rejection);
- ``EITHER``: a 200 or a 4xx (random mutations, lax coercions such as ``"5"`` for an integer).

Never a 5xx, never a hang. Valid bodies ask for at most 4 new tokens, so an accepted case costs a
few engine steps. Run it against a live server with ``python -m tests.fuzz.run``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

KINDS = ("orchestrator", "ctx", "gen")
REJECT, ACCEPT, EITHER = "reject", "accept", "either"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}
MAX_NEW_TOKENS = 2


@dataclass(frozen=True)
class Case:
    """One request: ``path`` (POST), raw ``body`` bytes, ``headers``, the class and the expectation."""

    index: int
    cls: str
    path: str
    body: bytes
    expect: str
    note: str
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))


def dumps(obj: object) -> bytes:
    """Compact JSON bytes (non-ASCII kept as UTF-8, as most clients send it)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def chat_body(model: str, content: object = "Say hi.", **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0, **extra}


def completion_body(model: str, prompt: object = "Once upon a time", **extra: object) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, **extra}


class Gen:
    """The generator state of one run: the rng, the model name, the vocabulary size, the kind."""

    def __init__(self, kind: str, seed: int, model: str, vocab_size: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.model, self.vocab = kind, model, vocab_size
        self.rng = random.Random(f"{kind}:{seed}")

    def base(self) -> tuple[str, dict]:
        """A valid body for one of the two endpoints."""
        if self.rng.random() < 0.5:
            return CHAT, chat_body(self.model)
        return COMPLETIONS, completion_body(self.model)

    def pick(self, options):
        return options[self.rng.randrange(len(options))]


# ---- raw JSON fragments -------------------------------------------------------------------------

HUGE_INVALID = ["1e309", "-1e309", str(2**70), str(-(2**70)), str(2**63), "9" * 5000, "-" + "9" * 4400]
HUGE_MAYBE = ["-0", "-0.0", "0e0", "1e-400", "4.9e-324", "1.7976931348623157e308", str(2**62), str(-(2**62)),
              "1" + "0" * 300]
NAN_LITERALS = ["NaN", "Infinity", "-Infinity", "nan", "inf"]
NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "seed", "max_tokens", "n", "presence_penalty",
                  "frequency_penalty"]
WRONG_TYPES: list[object] = [None, True, False, "x", "", "5", "0.5", 1, -1, 0.5, [], {}, [1], {"a": 1}, ["x"]]
FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream", "stream_options",
          "n", "ignore_eos", "user", "logit_bias", "presence_penalty", "frequency_penalty"]
BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"\xf8\x88\x80\x80\x80",
            b"\x80"]
LONE_SURROGATES = ["\\ud800", "\\udfff", "a\\ud83d", "\\ude00b", "\\udbff\\udbff"]
ODD_ROLES: list[object] = ["wizard", "", "USER", "function", "ipython", None, 1, ["user"], {"role": "user"}, "user "]


def replace_raw(body: dict, key: str, literal: str) -> bytes:
    """``body`` as JSON with ``body[key]`` replaced by a raw JSON literal (NaN, 1e309, …)."""
    marker = "__FUZZ_RAW__"
    return dumps({**body, key: marker}).replace(f'"{marker}"'.encode(), literal.encode())


def nested(depth: int, kind: str) -> str:
    """``depth`` levels of arrays, objects or both, as raw JSON text."""
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    half = depth // 2
    return '[{"a":' * half + "1" + "}]" * half


# ---- the classes: each returns (path, body, expectation, note[, headers]) ------------------------

def wrong_type(g: Gen):
    path, body = g.base()
    key = g.pick(FIELDS + (["messages"] if path == CHAT else ["prompt"]))
    value = g.pick(WRONG_TYPES)
    if key in ("messages", "prompt") and value in (None, [], {}):
        return path, dumps({**body, key: value}), REJECT, f"{key}={value!r}"
    return path, dumps({**body, key: value}), EITHER, f"{key}={value!r}"


def huge_number(g: Gen):
    path, body = g.base()
    key = g.pick(NUMERIC_FIELDS)
    if g.rng.random() < 0.5 or key == "max_tokens":  # a valid huge max_tokens would run to the context window
        literal = g.pick(HUGE_INVALID)
        return path, replace_raw(body, key, literal), REJECT, f"{key}={literal[:24]}"
    literal = g.pick(HUGE_MAYBE)
    return path, replace_raw(body, key, literal), EITHER, f"{key}={literal[:24]}"


def nan_inf(g: Gen):
    path, body = g.base()
    key = g.pick(NUMERIC_FIELDS + ["stop_token_ids", "logit_bias"])
    literal = g.pick(NAN_LITERALS)
    if key == "stop_token_ids":
        literal = f"[{literal}]"
    elif key == "logit_bias":
        literal = f'{{"1":{literal}}}'
    return path, replace_raw(body, key, literal), REJECT, f"{key}={literal}"


def invalid_utf8(g: Gen):
    path, body = g.base()
    raw = dumps(body)
    where = raw.index(b"Say hi" if path == CHAT else b"Once upon")
    bad = g.pick(BAD_UTF8)
    return path, raw[:where] + bad + raw[where:], REJECT, f"bytes {bad!r}"


def lone_surrogate(g: Gen):
    path, body = g.base()
    esc = g.pick(LONE_SURROGATES)
    key = "prompt" if path == COMPLETIONS else None
    target = g.pick(["text", "user", "stop", "key"])
    if target == "text" and key:
        raw = replace_raw(body, "prompt", f'"x{esc}y"')
    elif target == "text":
        raw = dumps(body).replace(b"Say hi.", f"Say {esc} hi.".encode())
    elif target == "key":
        raw = dumps(body)[:-1] + f',"k{esc}":1}}'.encode()
    else:
        raw = replace_raw(body, target, f'"{esc}"')
    return path, raw, REJECT, f"{target} {esc}"


def truncated(g: Gen):
    path, body = g.base()
    raw = dumps(body)
    cut = g.rng.randrange(0, len(raw) - 1)  # a proper prefix of an object is never a JSON object
    return path, raw[:cut], REJECT, f"cut at {cut}/{len(raw)}"


def deep_nesting(g: Gen):
    path, body = g.base()
    depth = g.pick([129, 200, 999, 1000, 1001, 5000, 100_000])
    shape = g.pick(["array", "object", "mixed"])
    where = g.pick(["body", "field", "content", "prompt"])
    text = nested(depth, shape)
    if where == "body":
        return path, text.encode(), REJECT, f"{shape} x{depth} as the body"
    if where == "content" and path == CHAT:
        raw = replace_raw(chat_body(g.model, "__C__"), "messages", f'[{{"role":"user","content":[{{"type":"text","text":"hi","x":{text}}}]}}]')
        return path, raw, REJECT, f"{shape} x{depth} in a content part"
    if where == "prompt" and path == COMPLETIONS:
        return path, replace_raw(body, "prompt", text), REJECT, f"{shape} x{depth} as the prompt"
    return path, replace_raw(body, "user", text), REJECT, f"{shape} x{depth} in user"


def content_parts(g: Gen):
    text = {"type": "text", "text": "Say hi."}
    variants = [
        ([text], ACCEPT), ([text, {"type": "text", "text": " Now."}], ACCEPT),
        ([{**text, "cache_control": {"type": "ephemeral"}}], ACCEPT),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}], REJECT),
        ([text, {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], REJECT),
        ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], REJECT),
        ([{"type": "refusal", "refusal": "no"}], REJECT), ([{"type": "video"}], REJECT),
        ([{"type": "text"}], REJECT), ([{"type": "text", "text": None}], REJECT),
        ([{"type": "text", "text": 5}], REJECT), ([{"text": "hi"}], REJECT), ([{}], REJECT),
        ([None], REJECT), ([1], REJECT), (["hi"], REJECT), ([[text]], REJECT), ([text, None], REJECT),
        ({"type": "text", "text": "hi"}, REJECT), (None, REJECT), (5, REJECT), (True, REJECT),
        ([{"type": None, "text": "hi"}], REJECT), ([{"type": ["text"], "text": "hi"}], REJECT),
    ]
    content, expect = g.pick(variants)
    return CHAT, dumps(chat_body(g.model, content)), expect, f"content={json.dumps(content)[:60]}"


def odd_role(g: Gen):
    role = g.pick(ODD_ROLES + ["system", "developer", "assistant", "tool", "user"])
    body = chat_body(g.model)
    body["messages"] = [{"role": role, "content": "hi"}]
    if role == "tool":  # a tool message answers a call: OpenAI requires its id (without it: 422)
        body["messages"][0]["tool_call_id"] = "call_1"
    valid = role in ("system", "developer", "assistant", "tool", "user")
    return CHAT, dumps(body), ACCEPT if valid else REJECT, f"role={role!r}"


def empty_messages(g: Gen):
    variants: list[tuple[object, str]] = [
        ([], REJECT), ([{}], REJECT), ([{"role": "user"}], REJECT), ([{"content": "hi"}], REJECT), (None, REJECT),
        ({}, REJECT), ("hi", REJECT), ([[]], REJECT), ([None], REJECT),
        ([{"role": "user", "content": ""}], ACCEPT), ([{"role": "user", "content": []}], ACCEPT),
        ([{"role": "user", "content": "hi", "name": "bob"}], ACCEPT),
        ([{"role": "user", "content": "hi", "bogus": 1}], REJECT),
    ]
    messages, expect = g.pick(variants)
    body = chat_body(g.model)
    body["messages"] = messages
    return CHAT, dumps(body), expect, f"messages={json.dumps(messages)[:60]}"


def token_ids(g: Gen):
    v = g.vocab
    variants: list[tuple[object, str]] = [
        ([-1], REJECT), ([v], REJECT), ([v + 1, 5], REJECT), ([2**31], REJECT), ([2**63], REJECT), ([2**70], REJECT),
        ([-(2**70)], REJECT), ([1.5], REJECT), ([True], REJECT), (["1"], ACCEPT), ([None], REJECT),
        ([[-1]], REJECT), ([[v]], REJECT), ([], REJECT), ([[]], REJECT), ([[1], [2]], REJECT), ([1, "a"], REJECT),
        ([5] * 10_000, REJECT), ([[5, 6], 7], REJECT), ([0], ACCEPT), ([v - 1], ACCEPT), ([5, 6, 7], ACCEPT),
        ([[5, 6, 7]], ACCEPT), (["Once"], ACCEPT), ("", REJECT), ([""], REJECT),
    ]
    prompt, expect = g.pick(variants)
    note = json.dumps(prompt)[:60]
    return COMPLETIONS, dumps(completion_body(g.model, prompt)), expect, f"prompt={note}"


CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "application/xml", "", "application/octet-stream",
                 "APPLICATION/JSON", "application/json; charset=utf-16"]


def content_type(g: Gen):
    path, body = g.base()
    ctype = g.pick(CONTENT_TYPES + [None])
    headers = {} if ctype is None else {"content-type": ctype}
    return path, dumps(body), EITHER, f"content-type={ctype!r}", headers


def empty_body(g: Gen):
    raw = g.pick([b"", b" ", b"\n", b"\r\n\t ", b"\x00", b"{", b"}", b"{}", b"null", b"0", b'""', b"true",
                  b"[]", b"[{}]", b"\xef\xbb\xbf", b"{,}", b'{"model"}'])
    return g.base()[0], raw, REJECT, f"body={raw!r}"


def non_object(g: Gen):
    path, body = g.base()
    raw = g.pick([dumps([body]), dumps(json.dumps(body)), b"12345", b"-0", b"1e309", b"NaN", b'"{}"',
                  dumps([body, body]), b"[" + dumps(body) + b"]"])
    return path, raw, REJECT, f"top level {raw[:20]!r}"


def out_of_range(g: Gen):
    path, body = g.base()
    key, value = g.pick([("temperature", -1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_p", -0.1),
                         ("max_tokens", 0), ("max_tokens", -1), ("n", 17), ("n", 0), ("top_k", -2),
                         ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("stop", [""]), ("stop", [f"s{i}" for i in range(17)]),
                         ("stop", ""), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("min_p", 1.5),
                         ("repetition_penalty", 0), ("top_logprobs", 21), ("stop_token_ids", [-1]), ("seed", 2**63)])
    return path, dumps({**body, key: value}), REJECT, f"{key}={json.dumps(value)[:40]}"


def unknown_field(g: Gen):
    path, body = g.base()
    # genuinely unknown keys only: `tools` and `response_format` are request fields now (issue 15)
    key = g.pick(["bogus", "toolz", "functions", "response_formats", "prompt" if path == CHAT else "messages",
                  "best_of_n", "Temperature", " model", ""])
    return path, dumps({**body, key: g.pick(WRONG_TYPES[1:])}), REJECT, f"unknown {key!r}"


def layout_of(g: Gen) -> dict:
    return {"model": g.model, "num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "block_size": 4, "dtype": "float32"}


def generation_only_params(g: Gen, layout: dict | None) -> dict:
    """Well-formed generation_only params whose KV source does not exist (tcp port 9, discard)."""
    return {"request_type": "generation_only", "disagg_request_id": "fuzz", "ctx_request_id": "ctx-fuzz",
            "first_gen_tokens": [5], "prompt_token_ids": [5, 6, 7], "kv_endpoint": "tcp://127.0.0.1:9",
            "kv_layout": layout or layout_of(g), "kv_block_count": 1}


# Each mutation makes generation_only params invalid before any KV is pulled.
GEN_BREAKS: list[tuple[str, object]] = [
    ("request_type", "generation"), ("request_type", None), ("request_type", 1), ("ctx_request_id", None),
    ("first_gen_tokens", None), ("first_gen_tokens", []), ("first_gen_tokens", [-1]), ("first_gen_tokens", [2**70]),
    ("first_gen_tokens", [10**9]), ("prompt_token_ids", None), ("prompt_token_ids", []), ("prompt_token_ids", [-5]),
    ("prompt_token_ids", [2**40]), ("prompt_token_ids", "abc"), ("prompt_token_ids", [5] * 10_000),
    ("kv_endpoint", None), ("kv_endpoint", ""), ("kv_endpoint", "garbage"), ("kv_endpoint", "http://127.0.0.1:9"),
    ("kv_endpoint", 5), ("kv_endpoints", ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]), ("kv_endpoints", []),
    ("kv_block_count", -1), ("kv_block_count", 2**70), ("kv_block_count", 10**6), ("kv_block_count", "x"),
    ("kv_layout", None), ("kv_layout", {}), ("kv_layout", {"model": 1}), ("kv_layouts", []), ("kv_block_count", 2),
    ("lease_deadline", "soon"), ("bogus", 1),
    ("kv_layout.block_size", 0), ("kv_layout.block_size", -4), ("kv_layout.block_size", 2**70),
    ("kv_layout.num_layers", 999), ("kv_layout.dtype", "float64"), ("kv_layout.model", "other"),
    ("kv_layout.tp_size", 0), ("kv_layout.tp_rank", 5), ("kv_layout.head_dim", 1.5), ("kv_layout.extra", 1),
]


def disaggregated(g: Gen):
    """``disaggregated_params`` from a client (orchestrator: always refused) or broken phase params."""
    path, body = g.base()
    if g.kind == "orchestrator":
        params = g.pick([{"request_type": "context_only"}, {"request_type": "generation_only"}, None, "x", {}])
        return path, dumps({**body, "disaggregated_params": params}), REJECT, f"client params {params!r}"
    if g.kind == "ctx" and g.rng.random() < 0.3:
        ctx = {"request_type": "context_only", "disagg_request_id": f"fuzz-{g.rng.randrange(10**9)}"}
        extra = g.pick([({}, ACCEPT), ({"stream": True}, REJECT), ({"ctx_request_id": 5}, REJECT),
                        ({"request_type": "generation_only"}, REJECT), ({"request_type": "bogus"}, REJECT)])
        params = {**ctx, **extra[0]}
        body = {**body, "max_tokens": 1, "disaggregated_params": params}
        if "stream" in params:
            body["stream"] = params.pop("stream")
        return path, dumps(body), extra[1], f"ctx params {json.dumps(params)[:60]}"
    params = generation_only_params(g, g.layout)
    key, value = g.pick(GEN_BREAKS)
    if key.startswith("kv_layout."):
        params["kv_layout"] = {**params["kv_layout"], key.split(".", 1)[1]: value}
    else:
        params[key] = value
    return path, dumps({**body, "disaggregated_params": params}), REJECT, f"gen params {key}={json.dumps(value)[:30]}"


def valid_unusual(g: Gen):
    """Bodies that common clients send and every kind must answer with 200."""
    m = g.model
    variants = [
        (CHAT, dumps(chat_body(m, "Emoji \U0001F600 and \u00e9\u4e2d\u6587"))),
        (CHAT, dumps(chat_body(m)).replace(b"Say hi.", b"Say \\ud83d\\ude00 hi.")),  # an escaped surrogate pair
        (CHAT, dumps(chat_body(m, temperature=None, top_p=None, seed=None, stop=None, user=None))),
        (CHAT, dumps(chat_body(m, max_completion_tokens=1, n=1, presence_penalty=0.0, frequency_penalty=0,
                               logit_bias={}, user="fuzz", logprobs=False))),
        (CHAT, dumps(chat_body(m, stream=True, stream_options={"include_usage": True}))),
        (CHAT, dumps(chat_body(m, logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                               metadata={"a": "b"}, store=False, service_tier="auto", min_p=0.1))),
        (COMPLETIONS, dumps(completion_body(m, [5, 6, 7], echo=True, logprobs=1, min_tokens=1, repetition_penalty=1.1,
                                            logit_bias={"5": -1}, stream=True,
                                            stream_options={"continuous_usage_stats": True}))),
        (CHAT, dumps(chat_body(m, stop="\n", stop_token_ids=[], seed=-(2**63), top_k=-1, top_p=1))),
        (CHAT, dumps(chat_body(m, seed=2**63 - 1, temperature=0.7, top_k=2**40, ignore_eos=True))),
        (CHAT, dumps({**chat_body(m), "messages": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "hi", "name": "u1"},
                                                     {"role": "assistant", "content": "Hello."},
                                                     {"role": "user", "content": [{"type": "text", "text": "bye"}]}]})),
        (CHAT, b'  \n{ "model" : "' + m.encode() + b'", "messages":[{"role":"user","content":"x"}],'
               b' "max_tokens": 2 , "temperature": -0 }\n\t'),
        (CHAT, dumps(chat_body(m))[:-1] + b',"max_tokens":1}'),  # duplicate key: the last one wins
        (COMPLETIONS, dumps(completion_body(m, "a\u0000b\u001f\u2028"))),
        (COMPLETIONS, dumps(completion_body(m, ["Once upon"], stream=True))),
        (COMPLETIONS, dumps(completion_body(m, [5, 6, 7], echo=False, logprobs=None, suffix=None, best_of=1))),
        (COMPLETIONS, dumps(completion_body(m, "x" * 2000))),
        (COMPLETIONS, dumps(completion_body(m, max_tokens=1.0, temperature=1e-300, top_p=4.9e-324 + 0.5))),
        (COMPLETIONS, dumps({"model": m, "prompt": "hi", "max_tokens": 2, "stop": ["a", "b"], "seed": 0})),
        (COMPLETIONS, json.dumps(completion_body(m, "\u00fc\u00f1\u00ee")).encode()),  # ASCII \u escapes
    ]
    path, raw = g.pick(variants)
    return path, raw, ACCEPT, f"valid {raw[:50]!r}"


def _random_value(g: Gen, depth: int = 0) -> object:
    r = g.rng.random()
    if depth > 2 or r < 0.5:
        return g.pick(WRONG_TYPES + [2**62, -(2**62), 1e300, "\u00e9", "a" * 300, 0, -0.0])
    if r < 0.75:
        return [_random_value(g, depth + 1) for _ in range(g.rng.randrange(4))]
    return {g.pick(["a", "text", "type", "role", ""]): _random_value(g, depth + 1) for _ in range(g.rng.randrange(3))}


def random_mutation(g: Gen):
    """1-3 random structural edits of a valid body (delete, replace, insert) at any depth."""
    path, body = g.base()
    notes = []
    for _ in range(g.rng.randrange(1, 4)):
        node = body
        while isinstance(node, (dict, list)) and node and g.rng.random() < 0.5:
            child = node[g.pick(list(node))] if isinstance(node, dict) else node[g.rng.randrange(len(node))]
            if not isinstance(child, (dict, list)):
                break
            node = child
        op = g.pick(["delete", "replace", "insert"])
        if isinstance(node, dict) and node:
            key = g.pick(list(node))
            if op == "delete":
                del node[key]
            elif op == "replace":
                node[key] = _random_value(g)
            else:
                node[g.pick(FIELDS + ["x"])] = _random_value(g)
            notes.append(f"{op} {key}")
        elif isinstance(node, list) and node:
            i = g.rng.randrange(len(node))
            if op == "delete":
                node.pop(i)
            elif op == "replace":
                node[i] = _random_value(g)
            else:
                node.insert(i, _random_value(g))
            notes.append(f"{op} [{i}]")
    if "messages" in body and not any(isinstance(body.get(k), int) and body[k] > 0
                                      for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = MAX_NEW_TOKENS  # a chat without a bound would run to the context window
    return path, dumps(body), EITHER, "; ".join(notes)


CLASSES = {
    "wrong_type": wrong_type, "huge_number": huge_number, "nan_inf": nan_inf, "invalid_utf8": invalid_utf8,
    "lone_surrogate": lone_surrogate, "truncated": truncated, "deep_nesting": deep_nesting,
    "content_parts": content_parts, "odd_role": odd_role, "empty_messages": empty_messages,
    "token_ids": token_ids, "content_type": content_type, "empty_body": empty_body, "non_object": non_object,
    "out_of_range": out_of_range, "unknown_field": unknown_field, "disaggregated": disaggregated,
    "valid_unusual": valid_unusual, "random_mutation": random_mutation,
}


def generate(kind: str, n: int, seed: int = 0, *, model: str = "tiny-llama", vocab_size: int = 49152,
             kv_layout: dict | None = None) -> list[Case]:
    """``n`` cases for a server ``kind``; the classes of :data:`CLASSES` are dealt round-robin.

    ``kv_layout``: the gen server's KV layout (so broken generation_only params fail on the field
    the case names, not on a layout mismatch). Raises ValueError for an unknown kind.
    """
    g = Gen(kind, seed, model, vocab_size)
    g.layout = kv_layout
    names = list(CLASSES)
    cases = []
    for i in range(n):
        name = names[i % len(names)]
        path, body, expect, note, *headers = CLASSES[name](g)
        cases.append(Case(i, name, path, body, expect, note, headers[0] if headers else dict(JSON_HEADERS)))
    return cases
