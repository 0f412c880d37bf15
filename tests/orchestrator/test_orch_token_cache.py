"""The orchestrator's routing tokenizer: a bounded text -> ids LRU, and ids equal to a plain encode."""

from __future__ import annotations

import pytest

from orchestrator.prompt_tokens import LoadedTokenizer
from orchestrator.token_cache import TokenCache

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def payload() -> dict:
    """A small BPE tokenizer trained here (no model files), with ChatML special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["the quick brown fox jumps over the lazy dog", "a stone in the river", "system user assistant"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>",
                                                                                      "<|im_end|>"]))
    return {"tokenizer_json": tok.to_str(), "chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>"}


def test_ids_equal_a_plain_encode_and_a_repeat_is_a_cache_hit(payload):
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(payload["tokenizer_json"])
    tok = LoadedTokenizer(payload)
    for text in ("the quick brown fox", "a stone in the river jumps", "<|im_start|>user\nthe dog<|im_end|>", ""):
        assert tok.encode(text) == plain.encode(text, add_special_tokens=False).ids
    misses = tok.cache.misses
    assert tok.encode("the quick brown fox") == plain.encode("the quick brown fox", add_special_tokens=False).ids
    assert tok.cache.misses == misses and tok.cache.hits >= 1


def test_chat_bodies_render_the_template_and_token_id_prompts_pass_through(payload):
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(payload["tokenizer_json"])
    tok = LoadedTokenizer(payload)
    body = {"messages": [{"role": "system", "content": "a stone"}, {"role": "user", "content": "the river"}]}
    text = "<|im_start|>system\na stone<|im_end|>\n<|im_start|>user\nthe river<|im_end|>\n<|im_start|>assistant\n"
    expected = plain.encode(text, add_special_tokens=False).ids
    assert tok.prompt_ids("/v1/chat/completions", body) == expected
    assert tok.prompt_ids("/v1/chat/completions", body) == expected  # from the cache: the same ids
    assert tok.prompt_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_the_cache_is_bounded_by_entries_and_by_tokens():
    cache = TokenCache(max_entries=3, max_tokens=10)
    for i in range(5):
        cache.put(f"t{i}", [i])
    assert len(cache) == 3 and cache.get("t0") is None and cache.get("t4") == [4]
    cache.get("t2")                      # now the most recent: t3 is the oldest
    cache.put("big", list(range(8)))     # 3 + 8 > 10 tokens: the oldest go first
    assert cache.get("t3") is None and cache.get("big") is not None and cache.tokens <= 10
    cache.put("huge", list(range(11)))   # larger than the whole budget: not kept
    assert cache.get("huge") is None and cache.tokens <= 10
    cache.put("big", [1])                # replacing an entry gives its tokens back
    assert cache.tokens == sum(len(cache.get(k) or []) for k in ("t2", "t4", "big"))
