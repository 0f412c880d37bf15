"""engine.tokenizer.Tokenizer.decode takes the tokenizers library's decode directly where
transformers' decode only forwards to it, and gives transformers' text exactly; a tokenizer that
cleans up spaces (or overrides decode) keeps transformers' path."""
import random

import pytest

from engine.model_files import resolve_model_path
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_model_path(resolve_model_path("smollm2"))


def test_backend_decode_equals_transformers(smollm2):
    assert smollm2._backend_decode is not None
    rnd = random.Random(0)
    special = smollm2.eos_token_ids
    for _ in range(2000):
        ids = [rnd.randrange(smollm2.vocab_size) for _ in range(rnd.randrange(0, 16))]
        if ids and rnd.random() < 0.3:
            ids.insert(rnd.randrange(len(ids)), rnd.choice(special))  # special tokens, skipped or not
        for skip in (True, False):
            assert smollm2.decode(ids, skip) == smollm2.hf.decode(ids, skip_special_tokens=skip), ids


def test_clean_up_spaces_keeps_transformers_decode(smollm2):
    hf = smollm2.hf
    old = hf.clean_up_tokenization_spaces
    try:
        hf.clean_up_tokenization_spaces = True
        assert Tokenizer(hf, smollm2.eos_token_ids)._backend_decode is None
    finally:
        hf.clean_up_tokenization_spaces = old


def test_a_non_transformers_tokenizer_keeps_its_decode():
    class Plain:
        eos_token_id = None

        def __len__(self):
            return 4

        def decode(self, ids, skip_special_tokens=True):
            return "".join("abcd"[i] for i in ids)

    tok = Tokenizer(Plain(), [])
    assert tok._backend_decode is None and tok.decode([0, 3]) == "ad"
