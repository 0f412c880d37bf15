"""Token sampling: greedy, temperature, top-k, top-p; seeded per output position."""
from __future__ import annotations

import hashlib

import torch

from engine.sampling_params import SamplingParams


def position_seed(seed: int, index: int) -> int:
    """Seed for output token number `index` of a request seeded with `seed` (63-bit)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _filter(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [V] float32 -> probabilities [V] after temperature, top-k and top-p."""
    logits = logits / sp.temperature
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= sp.top_p   # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


class Sampler:
    """Picks one token per row of logits. Unseeded requests share the engine-level generator."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int]) -> list[int]:
        """logits: [S, V] float32; output_indices[i]: which output token row i produces."""
        greedy = logits.argmax(dim=-1).tolist()
        tokens = []
        for row, (sp, idx) in enumerate(zip(params, output_indices)):
            if sp.greedy:
                tokens.append(greedy[row])
                continue
            gen = self.generator
            if sp.seed is not None:
                gen = torch.Generator().manual_seed(position_seed(sp.seed, idx))
            probs = _filter(logits[row], sp)
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
        return tokens
