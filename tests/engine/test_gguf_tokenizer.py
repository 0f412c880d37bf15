"""The GGUF fast-path tokenizer equals transformers' GGUF conversion token for token."""
import json
import random

import pytest

from engine.gguf_tokenizer import hf_tokenizer_from_gguf, tokenizer_json
from engine.model_files import resolve_model_path

from engine_testutil import PROMPTS

_PIECES = ["hello", " world", "  ", "\t", "\n", "\n\n", "\r\n", "é", "ñ", "ü", "ß", "日本語",
           "中文", "한국어", "Привет", "مرحبا", "שלום", "🙂", "👩‍💻", "🇫🇷", "e\u0301", "\u200b",
           "\u00a0", "123", "4567", "3.14", "-42", "def f(x):", "    return x", "{}", "[]",
           "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<im_start>", "'s", "'ll", "n't",
           "http://a.b/c?d=e", "foo_bar", "CamelCase", "ALLCAPS", "...", "!!", "¿Qué?", "½",
           "\x00", "\U0001f600", "𝔘𝔫𝔦", "ﬁ", "Ⅻ"]


def _strings() -> list[str]:
    rnd = random.Random(0)
    out = list(PROMPTS) + list(_PIECES) + ["", " ", "a" * 300]
    for _ in range(300):
        out.append("".join(rnd.choice(_PIECES) for _ in range(rnd.randint(1, 12))))
    return out


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer
    path = resolve_model_path("smollm2")
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # ~10-18 s
    return hf_tokenizer_from_gguf(path), ref


def test_same_pipeline(tokenizers):
    fast, ref = tokenizers
    assert json.loads(fast.backend_tokenizer.to_str()) == \
        json.loads(ref.backend_tokenizer.to_str())
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "chat_template"):
        assert getattr(fast, attr) == getattr(ref, attr), attr
    assert len(fast) == len(ref)


def test_encode_decode_match(tokenizers):
    fast, ref = tokenizers
    for s in _strings():
        for special in (False, True):
            ids = fast.encode(s, add_special_tokens=special)
            assert ids == ref.encode(s, add_special_tokens=special), s
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip), s


def test_chat_template_match(tokenizers):
    fast, ref = tokenizers
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
             [{"role": "user", "content": "日本語で"}, {"role": "assistant", "content": "はい"},
              {"role": "user", "content": "ok\n\nthen"}]]
    for msgs in convs:
        for gen in (False, True):
            a = fast.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert a == ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert fast.encode(a) == ref.encode(a)


def test_non_gpt2_gguf_is_refused():
    with pytest.raises(ValueError):
        tokenizer_json({"tokenizer.ggml.model": "llama"})
