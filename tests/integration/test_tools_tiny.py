"""Tools and reasoning on real engines (tiny random Llama, in-process cluster, official openai client).

The tiny model's tokenizer has no tool-aware chat template, so the test writes one (Hermes style,
as Qwen2.5's renders tools, calls and tool responses). A random model never writes a tool call by
itself, so the tests that need one force its tokens with a *test-only logit bias*: this process's
sampler gets a wrapper around ``engine.sampler.process_logits`` that, for requests carrying a
``logit_bias`` (which makes the engine run its processors), leaves only the next token of a
script at finite logit. Everything after the logits is the servers' real path (detokenizer, stop
checks, parsers, relay), on the ctx server (first token) and the gen server (the rest).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch

import engine.sampler
from engine.tokenizer import Tokenizer
from tests.integration.threaded_cluster import MODEL, ThreadedCluster
from tests.chat_stream import rebuild_chat_stream

TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT = "<think>Paris is in France.</think>\n\nParis."
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
BIAS = {"logit_bias": {"0": 0}}  # makes the engine run its logits processors (where the script acts)


class Script:
    """The token ids the wrapped processors force (None: no forcing); past its end, EOS."""

    ids: list[int] | None = None
    eos: int = 2


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with the Hermes-style template above as its chat template."""
    path = tmp_path_factory.mktemp("tiny-tools")
    for f in Path(tiny_model_dir).iterdir():
        (path / f.name).symlink_to(f)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.unlink()
    cfg_path.write_text(json.dumps(cfg))
    if (path / "chat_template.jinja").exists():
        (path / "chat_template.jinja").unlink()
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def cluster(tool_model_dir, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    original = engine.sampler.process_logits

    def forcing(logits, params, history, eos_token_ids):
        out = original(logits, params, history, eos_token_ids)
        if Script.ids is None:
            return out
        out = out.clone() if out is logits else out
        for row, (_, output) in enumerate(history):
            pos = len(output)
            out[row] = float("-inf")
            out[row, Script.ids[pos] if pos < len(Script.ids) else Script.eos] = 0.0
        return out

    mp.setattr(engine.sampler, "process_logits", forcing)
    c = ThreadedCluster.start(tool_model_dir, tmp_path_factory.mktemp("tools"),
                              model={"tool_call_parser": "hermes", "reasoning_parser": "qwen3"})
    yield c
    c.stop()
    mp.undo()


@pytest.fixture(scope="module")
def tok(tool_model_dir) -> Tokenizer:
    return Tokenizer.from_model_path(tool_model_dir)


@pytest.fixture
def script(tok):
    def force(text: str) -> list[int]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text  # the script decodes back to exactly the text
        Script.ids = ids
        return ids
    yield force
    Script.ids = None


@pytest.fixture(scope="module")
def clients(cluster) -> dict[str, openai.OpenAI]:
    """``disagg``: through the orchestrator; ``colocated``: the gen server by itself (it parses there)."""
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for name, url in (("disagg", cluster.url), ("colocated", cluster.server_url("gen")))}


def answer(client, stream: bool, **kw) -> dict:
    """(content, reasoning, calls without ids, finish) of one chat call, rebuilt from deltas when streaming."""
    kw = {"model": MODEL, "messages": HISTORY[:1], "max_tokens": 40, "temperature": 0, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.id.startswith("call_") for c in m.tool_calls or [])
        return {"content": m.content, "reasoning": getattr(m, "reasoning_content", None), "calls": calls,
                "finish": r.choices[0].finish_reason}
    got = rebuild_chat_stream(client.chat.completions.create(**kw, stream=True))
    return {**got, "calls": [(c["name"], c["arguments"]) for c in got["calls"]]}


def rendered(url: str, body: dict) -> str:
    ids = httpx.post(url + "/tokenize", json={"model": MODEL, **body}, timeout=30).json()["tokens"]
    return httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json()["prompt"]


def test_the_template_gets_tools_history_and_kwargs(cluster):
    body = {"messages": HISTORY, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
    text = rendered(cluster.server_url("gen"), body)
    assert "Tools: get_weather" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text  # a mapping
    assert '<tool_response id="call_1">sunny, 21 C</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered(cluster.url, body) == text  # the orchestrator relays /tokenize to a server
    assert "<think>" not in rendered(cluster.server_url("gen"), {"messages": HISTORY})


def test_chat_template_kwargs_reach_the_template_of_a_chat_call(clients, cluster):
    """enable_thinking false adds the template's empty think block: the prompt the chat call counts
    grows by exactly its tokens, and the answer (greedy) is the same on both paths, stream and not."""
    think = {"chat_template_kwargs": {"enable_thinking": False}}
    counts = {key: httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "messages": HISTORY[:1], **body},
                              timeout=30).json()["count"] for key, body in (("plain", {}), ("think", think))}
    assert counts["think"] > counts["plain"]
    texts = set()
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            for key, extra in (("plain", {}), ("think", think)):
                kw = dict(model=MODEL, messages=HISTORY[:1], max_tokens=6, temperature=0,
                          extra_body={"ignore_eos": True, **extra})
                if stream:
                    chunks = list(clients[name].chat.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}))
                    usage, text = chunks[-1].usage, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                else:
                    r = clients[name].chat.completions.create(**kw)
                    usage, text = r.usage, r.choices[0].message.content
                assert usage.prompt_tokens == counts[key], (name, stream, key)
                texts.add((key, text))
    assert len(texts) == 2, texts   # one answer per template variant, everywhere the same


def test_history_with_tool_messages_disaggregated_equals_colocated(clients):
    kw = dict(messages=HISTORY, tools=[WEATHER], max_tokens=12, extra_body={"ignore_eos": True})
    want = answer(clients["colocated"], False, **kw)
    assert want["finish"] == "length" and want["content"]
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            assert answer(clients[name], stream, **kw) == want, (name, stream)


def test_auto_tool_call_everywhere_the_same(clients, script):
    script(CALL_TEXT)
    want = {"content": "Checking.", "reasoning": None, "finish": "tool_calls",
            "calls": [("get_weather", '{"city": "Paris"}')]}
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            assert answer(clients[name], stream, tools=[WEATHER], extra_body=BIAS) == want, (name, stream)


def test_reasoning_content_everywhere_the_same(clients, script):
    script(THINK_TEXT)
    want = {"content": "Paris.", "reasoning": "Paris is in France.", "calls": [], "finish": "stop"}
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            assert answer(clients[name], stream, extra_body=BIAS) == want, (name, stream)


def test_a_call_cut_by_max_tokens_keeps_length(clients, script, tok):
    ids = script(CALL_TEXT)
    cut = len(tok.encode(CALL_TEXT[:CALL_TEXT.index('"Paris"')]))
    for name in ("disagg", "colocated"):
        got = answer(clients[name], False, tools=[WEATHER], max_tokens=cut, extra_body=BIAS)
        assert got["finish"] == "length" and got["calls"][0][0] == "get_weather", name
        assert got["calls"][0][1] == tok.decode(ids[:cut]).split('"arguments": ')[1], name


def test_tool_choice_none_and_no_bias_are_plain_text(clients, script):
    script(CALL_TEXT)
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            got = answer(clients[name], stream, tools=[WEATHER], tool_choice="none", extra_body=BIAS)
            assert got == {"content": CALL_TEXT, "reasoning": None, "calls": [], "finish": "stop"}, (name, stream)


def test_bad_requests_are_400_on_the_server_too(clients):
    for kw in ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
               {"messages": [{"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}):
        with pytest.raises(openai.BadRequestError):
            answer(clients["colocated"], False, **kw)


SHORT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_choice_gives_schema_valid_arguments_everywhere_the_same(clients, seed):
    import jsonschema

    kw = dict(tools=[SHORT_WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=1.0, seed=seed, max_tokens=60)
    want = answer(clients["colocated"], False, **kw)  # a random model, held to the call's schema by the grammar
    assert want["finish"] == "tool_calls" and want["content"] is None, want
    (name, arguments), = want["calls"]
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), SHORT_WEATHER["function"]["parameters"])
    for client in ("disagg", "colocated"):
        for stream in (False, True):
            assert answer(clients[client], stream, **kw) == want, (client, stream)


def test_required_calls_one_of_the_tools(clients):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (SHORT_WEATHER, TIME)}
    for seed in (4, 5):
        kw = dict(tools=[SHORT_WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed, max_tokens=60)
        got = answer(clients["disagg"], False, **kw)
        (name, arguments), = got["calls"]
        assert got["finish"] == "tool_calls"
        jsonschema.validate(json.loads(arguments), schemas[name])
        for client, stream in (("disagg", True), ("colocated", False), ("colocated", True)):
            assert answer(clients[client], stream, **kw) == got, (client, stream)


def test_a_forced_choice_with_response_format_is_a_400(clients):
    with pytest.raises(openai.BadRequestError):
        answer(clients["colocated"], False, tools=[SHORT_WEATHER], tool_choice="required",
               response_format={"type": "json_object"})


@pytest.fixture(scope="module")
def no_migration(tool_model_dir, cluster, tmp_path_factory):
    """A second cluster with ``migration_limit: 0``: a non-streaming gen answer is relayed as the gen
    server wrote it, so the gen server parses it (a stream is still assembled, and parsed, by the
    orchestrator). It reuses ``cluster``'s forcing wrapper (same process)."""
    c = ThreadedCluster.start(tool_model_dir, tmp_path_factory.mktemp("tools-nomig"),
                              orchestrator={"migration_limit": 0},
                              model={"tool_call_parser": "hermes", "reasoning_parser": "qwen3"})
    yield openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    c.stop()


def test_with_migration_off_the_gen_server_parses_its_json_answer(no_migration, script):
    script(CALL_TEXT)
    want = {"content": "Checking.", "reasoning": None, "finish": "tool_calls",
            "calls": [("get_weather", '{"city": "Paris"}')]}
    for stream in (False, True):
        assert answer(no_migration, stream, tools=[WEATHER], extra_body=BIAS) == want, stream


def answers_n(client, stream: bool, n: int, **kw) -> list[dict]:
    """:func:`answer` for each of ``n`` choices (index order), rebuilt per index when streaming."""
    kw = {"model": MODEL, "messages": HISTORY[:1], "max_tokens": 40, "temperature": 0, "n": n, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        assert [c.index for c in r.choices] == list(range(n))
        return [{"content": c.message.content, "reasoning": getattr(c.message, "reasoning_content", None),
                 "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
                 "finish": c.finish_reason} for c in r.choices]
    parts = {i: {"content": [], "reasoning": [], "calls": {}, "finish": None} for i in range(n)}
    for ch in client.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            p, d = parts[choice.index], choice.delta
            p["content"].append(d.content or "")
            p["reasoning"].append(getattr(d, "reasoning_content", None) or "")
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    p["calls"][tc.index] = [tc.function.name, ""]
                p["calls"][tc.index][1] += tc.function.arguments or ""
            p["finish"] = choice.finish_reason or p["finish"]
    return [{"content": "".join(p["content"]) or None, "reasoning": "".join(p["reasoning"]) or None,
             "calls": [tuple(p["calls"][i]) for i in sorted(p["calls"])], "finish": p["finish"]}
            for p in parts.values()]


def test_n_choices_each_parse_their_own_call_and_reasoning(clients, script):
    """One parser per choice: the choices' interleaved texts never meet in one parse state."""
    script(THINK_TEXT)
    want = {"content": "Paris.", "reasoning": "Paris is in France.", "calls": [], "finish": "stop"}
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            assert answers_n(clients[name], stream, 3, extra_body=BIAS) == [want] * 3, (name, stream)
    script(CALL_TEXT)
    want = {"content": "Checking.", "reasoning": None, "finish": "tool_calls",
            "calls": [("get_weather", '{"city": "Paris"}')]}
    for name in ("disagg", "colocated"):
        for stream in (False, True):
            assert answers_n(clients[name], stream, 2, tools=[WEATHER], extra_body=BIAS) == [want] * 2, (name, stream)


def test_n_choices_of_a_named_call_each_follow_the_grammar(clients):
    """tool_choice named -> a json_schema grammar: every sampled choice has its own matcher."""
    import jsonschema

    kw = dict(tools=[SHORT_WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=1.0, seed=7, max_tokens=60)
    want = answers_n(clients["colocated"], False, 3, **kw)
    for got in want:
        assert got["finish"] == "tool_calls" and got["content"] is None, got
        (name, arguments), = got["calls"]
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), SHORT_WEATHER["function"]["parameters"])
    assert len({g["calls"][0][1] for g in want}) > 1  # the choices differ
    for client in ("disagg", "colocated"):
        for stream in (False, True):
            assert answers_n(clients[client], stream, 3, **kw) == want, (client, stream)
