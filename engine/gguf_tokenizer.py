"""Build the HF tokenizer of a GGUF file straight from its metadata (GPT-2 style BPE).

transformers' own GGUF path (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) parses the
file with gguf.GGUFReader and converts it slowly (~10-18 s for SmolLM2); this builds the same
`tokenizers` pipeline (byte-level BPE, GPT-2 regex, special tokens from token_type == CONTROL)
from engine.gguf_reader's metadata in well under a second.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.gguf_reader import read_gguf

_CONTROL, _USER_DEFINED = 3, 4    # llama.cpp token types that become added (special) tokens


def tokenizer_json(meta: dict[str, Any]) -> str:
    """tokenizer.json text for a GGUF whose tokenizer.ggml.model is "gpt2".

    Raises ValueError for other tokenizer models (callers fall back to transformers).
    """
    return json.dumps(tokenizer_doc(meta), ensure_ascii=False)


def tokenizer_doc(meta: dict[str, Any]) -> dict[str, Any]:
    """:func:`tokenizer_json` as the JSON document (a dict) before it is written out.
    Raises ValueError as :func:`tokenizer_json`."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"no fast path for GGUF tokenizer {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": types[i] != _CONTROL, "special": types[i] == _CONTROL}
             for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": bool(
        meta.get("tokenizer.ggml.add_space_prefix", False)), "trim_offsets": True,
        "use_regex": True}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {}},
        "decoder": {**byte_level, "add_prefix_space": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in meta.get("tokenizer.ggml.merges", [])]},
    }
    return doc


def _token(meta: dict[str, Any], key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if i is None else meta["tokenizer.ggml.tokens"][int(i)]


def hf_tokenizer_from_gguf(path: Path) -> Any:
    """A transformers fast tokenizer equal (token for token) to transformers' GGUF conversion.

    Raises ValueError when the GGUF's tokenizer is not GPT-2 style BPE.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    meta, _, _ = read_gguf(path)
    raw = RawTokenizer.from_str(tokenizer_json(meta))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=_token(meta, "bos"), eos_token=_token(meta, "eos"),
        unk_token=_token(meta, "unknown"), pad_token=_token(meta, "padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
