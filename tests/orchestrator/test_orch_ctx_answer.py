"""The ctx answer's prompt_token_ids ride into the gen body as raw JSON, never decoded."""

from __future__ import annotations

import json

from orchestrator import jsonio
from orchestrator.ctx_answer import parse_ctx_answer


def ctx_answer(ids: list[int], text: str = "Hi") -> bytes:
    params = {"ctx_request_id": "c1", "prompt_token_ids": ids, "first_gen_tokens": [7], "kv_block_count": 2}
    doc = {"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": None, "disaggregated_params": params}]}
    return json.dumps(doc, separators=(",", ":")).encode()


def test_ids_pass_through_as_a_fragment_and_encode_identically():
    ids = list(range(5000))
    raw = ctx_answer(ids)
    answer = parse_ctx_answer(raw)
    params = answer["choices"][0]["disaggregated_params"]
    assert isinstance(params["prompt_token_ids"], jsonio.Fragment)
    assert params["ctx_request_id"] == "c1" and params["first_gen_tokens"] == [7]
    gen_body = jsonio.dumps({"prompt": "p", "disaggregated_params": {**params, "request_type": "generation_only"}})
    assert json.loads(gen_body)["disaggregated_params"]["prompt_token_ids"] == ids


def test_the_key_inside_generated_text_is_not_cut():
    tricky = 'say "prompt_token_ids":[1,2] ok]'
    answer = parse_ctx_answer(ctx_answer([1, 2, 3], text=tricky))
    assert answer["choices"][0]["text"] == tricky
    assert json.loads(jsonio.dumps(answer))["choices"][0]["disaggregated_params"]["prompt_token_ids"] == [1, 2, 3]


def test_unexpected_shapes_fall_back_to_a_full_parse():
    final = b'{"choices":[{"index":0,"text":"x","finish_reason":"stop"}]}'
    assert parse_ctx_answer(final)["choices"][0]["finish_reason"] == "stop"
    odd = b'{"prompt_token_ids":["a"],"choices":[]}'
    assert parse_ctx_answer(odd) == {"prompt_token_ids": ["a"], "choices": []}
    spaced = json.dumps({"choices": [{"disaggregated_params": {"prompt_token_ids": [4, 5]}}]}).encode()
    assert parse_ctx_answer(spaced)["choices"][0]["disaggregated_params"]["prompt_token_ids"] == [4, 5]
