"""One position's log-probability record (:class:`TokenLogprob`): a torch-free type shared by the
engine, the frontends and the response formats (computed in :mod:`engine.logprob_math`).

From the raw distribution: ``log_softmax`` of the model's float32 logits before any logits
processor, temperature or filter (vLLM's default ``logprobs_mode``, and what HF's
``log_softmax(model(...).logits)`` gives), so the numbers do not depend on how a token was picked.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability (natural log) and the ``k`` most likely
    tokens as ``(token id, logprob)`` pairs in descending order (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
