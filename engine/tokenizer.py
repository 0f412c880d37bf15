"""Tokenizer wrapper around a HF (tokenizers-backed) tokenizer, with the model's chat template."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from engine.model_files import is_gguf

log = logging.getLogger(__name__)


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _from_gguf(path: Path) -> Any:
    """Fast path from the GGUF metadata; transformers' (slow) GGUF conversion otherwise.

    The conversion goes through PreTrainedTokenizerFast, not AutoTokenizer: the same builder
    (transformers' GGUF tokenizer mapping, by the file's architecture and tokenizer model), but
    AutoTokenizer first parses the whole file again for its config (gguf.GGUFReader, one numpy
    view per vocabulary entry): Gemma 3 270M's 262,144-token SentencePiece vocabulary took 61 s
    that way against 12.5 s, token-for-token equal (tests/engine/test_gemma3.py)."""
    from engine.gguf_tokenizer import hf_tokenizer_from_gguf
    try:
        return hf_tokenizer_from_gguf(path)
    except ValueError as e:
        log.info("%s: %s; using transformers' GGUF tokenizer conversion", path.name, e)
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def _backend_decode(hf: Any):
    """The ``tokenizers`` library's own ``decode`` of ``hf`` where transformers' ``decode`` only
    forwards to it (a TokenizersBackend that overrides neither ``decode`` nor ``_decode`` and does
    no ``clean_up_tokenization_spaces`` pass); else None. The detokenizer decodes twice per output
    token, and transformers' wrapper (input conversion, isinstance checks, kwargs) cost more than
    the decode itself right after a forward has evicted the caches."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(hf)
    if (not isinstance(hf, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode or hf.clean_up_tokenization_spaces):
        return None
    return hf.backend_tokenizer.decode


class Tokenizer:
    """encode/decode/apply_chat_template plus the EOS ids and vocabulary size.

    `hf` is the underlying transformers tokenizer (save_pretrained writes its files); `source`:
    the .gguf file or HF directory it was loaded from (None when built from an object).
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: list[int], source: Path | None = None):
        self.hf = hf_tokenizer
        self.source = source
        ids = list(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in ids:
            ids.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids: list[int] = ids
        self.vocab_size: int = len(hf_tokenizer)
        self._backend_decode = _backend_decode(hf_tokenizer)

    @classmethod
    def from_model_path(cls, path: Path, eos_token_ids: list[int] | None = None) -> "Tokenizer":
        """Load from a .gguf file or a HF directory (no network). Raises OSError if absent."""
        from transformers import AutoTokenizer  # local: heavy import
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        eos = list(eos_token_ids or [])
        if is_gguf(path):
            hf = _from_gguf(path)
        else:
            hf = AutoTokenizer.from_pretrained(str(path))
            eos += [e for e in _generation_eos(path) if e not in eos]
        return cls(hf, eos, Path(path))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (a list of ints), as ``hf.decode`` gives it."""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Render messages with the model's own chat template and tokenize the result.

        ``tools`` (OpenAI's JSON shape) reach the template as ``tools``; ``template_kwargs`` as
        extra template variables (``chat_template_kwargs``, e.g. ``enable_thinking``).
        Raises ValueError when the tokenizer has no chat template or the template fails.
        """
        import jinja2

        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               tokenize=False, tools=tools, **(template_kwargs or {}))
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template failed: {err}") from None
        return self.encode(text, add_special_tokens=False)
