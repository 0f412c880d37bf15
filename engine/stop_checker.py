"""Decide whether a sequence is done after a new token, and which text may be streamed."""
from __future__ import annotations

from engine.sequence import Sequence
from pdserve.stop_text import held_back_len

__all__ = ["find_stop_string", "held_back_len", "token_finish_reason"]


def token_finish_reason(seq: Sequence, token_id: int, eos_token_ids: frozenset[int],
                        max_model_len: int) -> str | None:
    """"stop" for EOS (unless ignore_eos) or a stop token, "length" for max_tokens/max_model_len."""
    sp = seq.sampling
    if (token_id in eos_token_ids and not sp.ignore_eos) or token_id in sp.stop_token_ids:
        return "stop"
    if sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None


def find_stop_string(text: str, stops: list[str], start: int) -> int | None:
    """Smallest index >= start (per stop, searched from start) where a stop string begins."""
    hits = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None
