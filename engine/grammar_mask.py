"""Grammar token masks as tensors: each constrained row's allowed next tokens, and their application.

One step: every constrained row's matcher writes its bitmask (ceil(V / 32) int32 words; bit
``t % 32`` of word ``t // 32`` is token ``t``, llguidance's layout) into one host tensor; that
tensor (6 KiB a row for V = 49,152) goes to the logits' device once and is unpacked there to a
bool mask [R, V]. :func:`apply_grammar` sets every disallowed logit to -inf, so greedy picking is
the argmax over the allowed tokens and sampling draws only among them; logprobs are computed from
the logits before it (engine.logprobs: the raw distribution).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from engine.structured_output import GrammarMatcher


@dataclass(frozen=True)
class GrammarRows:
    """rows: the constrained rows of a step's logits; allowed: bool [len(rows), V] on the logits'
    device, True where the row's grammar allows the token."""

    rows: list[int]
    allowed: torch.Tensor


if sys.byteorder != "little":  # _unpack reads the library's int32 words byte by byte
    raise ImportError("engine.grammar_mask assumes a little-endian host")

_BITS: dict[torch.device, torch.Tensor] = {}  # per device: bool [256, 8], row b = the bits of byte b


def _bit_table(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)
    return _BITS[device]


def _unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [R, W] -> bool [R, vocab] (bit j of word w is token 32 w + j).

    One lookup of each byte in a 256-row table (little-endian words: byte b of word w holds tokens
    32 w + 8 b .. + 7; x86 and CUDA devices are little-endian): no [R, W, 32] integer temporary."""
    table = _bit_table(bits.device)
    return table[bits.contiguous().view(torch.uint8).long()].view(bits.shape[0], -1)[:, :vocab]


def fill_bitmask(matchers: list[GrammarMatcher], vocab: int) -> torch.Tensor:
    """int32 [len(matchers), ceil(vocab / 32)] on the host: each matcher's allowed next tokens
    (the library's mask computation)."""
    words = (vocab + 31) // 32
    bits = torch.empty(len(matchers), words, dtype=torch.int32)
    for r, m in enumerate(matchers):
        m.fill_mask(bits[r].data_ptr(), words * 4)
    return bits


def allowed_tokens(bits: torch.Tensor, matchers: list[GrammarMatcher], vocab: int,
                   device: torch.device) -> torch.Tensor:
    """The bitmask on ``device`` as bool [R, vocab]; every EOS id the library does not know
    follows its one EOS (GrammarMatcher.eos_token_ids)."""
    allowed = _unpack(bits.to(device, non_blocking=True), vocab)
    for r, m in enumerate(matchers):
        others = [e for e in m.eos_token_ids if e != m.library_eos and e < vocab]
        if others:
            allowed[r, others] = allowed[r, m.library_eos].clone()
    return allowed


def grammar_rows(matchers: list[GrammarMatcher | None], vocab: int, device: torch.device) -> GrammarRows | None:
    """The masks of one step's rows (matchers[i]: row i's grammar, None = unconstrained); None when
    no row is constrained."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    live = [matchers[i] for i in rows]
    return GrammarRows(rows, allowed_tokens(fill_bitmask(live, vocab), live, vocab, device))


def apply_grammar(logits: torch.Tensor, grammar: GrammarRows, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] -> a new tensor with -inf where a constrained row's grammar disallows a token.

    fallback [S, V] (the logits before the logits processors): a constrained row that the
    processors left with no allowed token (``min_tokens`` banning the EOS a finished grammar
    demands) takes its masked fallback row instead, so a grammar's end always wins."""
    dev = logits.device
    whole = len(grammar.rows) == logits.shape[0]
    idx = None if whole else torch.tensor(grammar.rows, device=dev)
    sub = logits if whole else logits.index_select(0, idx)
    masked = sub.masked_fill(~grammar.allowed, float("-inf"))
    if fallback is not None and fallback is not logits:
        dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
        base = fallback if whole else fallback.index_select(0, idx)
        masked = torch.where(dead, base.masked_fill(~grammar.allowed, float("-inf")), masked)
    return masked if whole else logits.index_copy(0, idx, masked)
