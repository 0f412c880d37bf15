"""Incremental detokenization: UTF-8 safety and equality with a full decode."""
from engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Each id is one byte: multi-byte characters always span several tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    deltas = [d.push([i]) for i in ids]
    return deltas, d.flush()


def test_split_multibyte_characters_are_held_back():
    text = "aé世🎉b"
    ids = list(text.encode())
    deltas, tail = _stream(ByteTokenizer(), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text and tail == ""
    assert deltas[:3] == ["a", "", "é"]


def test_truncated_sequence_flushes_like_decode():
    ids = list("ok🎉".encode())[:-1]            # cut inside the emoji
    deltas, tail = _stream(ByteTokenizer(), ids)
    assert "".join(deltas) == "ok" and "".join(deltas) + tail == ByteTokenizer().decode(ids)


def test_real_tokenizer_matches_full_decode(tiny_engine):
    tok = tiny_engine.tokenizer
    text = "Grüße aus Köln — 東京タワー 🎉🚀 naïve café ∑x² ok"
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids) == text


def test_tokenizer_roundtrip_and_chat_template(tiny_engine):
    tok = tiny_engine.tokenizer
    assert tok.vocab_size == 49152 and 2 in tok.eos_token_ids
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("hello world")) == "hello world"
