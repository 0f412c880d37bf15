"""Counter-based randomness for sampling: a pure function of (seed, choice, position, token id).

The generator is SplitMix64 (Steele, Lea and Flood, "Fast Splittable Pseudorandom Number
Generators", OOPSLA 2014; constants as in Vigna's public-domain ``splitmix64.c``): the n-th
output of a stream whose state is ``s`` is ``mix(s + n * GAMMA)`` with

    mix(z): z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            return z ^ (z >> 31)          (64-bit unsigned, wrapping, logical shifts)

A sampled row's stream key chains three steps, ``key = f(f(f(seed) ^ choice) ^ position)`` with
``f(x) = mix(x + GAMMA)``, and the uniform for token id ``v`` is output ``v + 1`` of the stream
``key``: ``mix(key + (v + 1) * GAMMA)``, its top 24 bits mapped to ``(k + 0.5) / 2**24`` in (0, 1).
Everything is evaluated with torch int64 ops (two's complement wraps like uint64; logical shifts
are an arithmetic shift plus a mask), so it runs on any device and gives the same bits on all of
them, independent of the batch a row is in.
"""
from __future__ import annotations

import torch

_M64 = (1 << 64) - 1


def as_int64(x: int) -> int:
    """A Python int taken modulo 2**64, as the signed int64 with the same bits."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = as_int64(0x9E3779B97F4A7C15)
_MUL1 = as_int64(0xBF58476D1CE4E5B9)
_MUL2 = as_int64(0x94D049BB133111EB)
UNIFORM_BITS = 24  # float32 holds 24-bit integers exactly on every device


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (any shape), elementwise."""
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def stream_keys(seeds: torch.Tensor, choices: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
    """Per-row stream keys: seeds, choices, positions [B] int64 -> [B] int64."""
    key = mix64(seeds + GAMMA)
    key = mix64((key ^ choices) + GAMMA)
    return mix64((key ^ positions) + GAMMA)


# (2**24 - 1 + 0.5) / 2**24 rounds to 1.0 in float32, whose Gumbel noise is +inf: that token would win
# whatever its logit (and a -inf logit + inf is NaN, which argmax also picks). The largest float32 below 1:
U_MAX = 1.0 - 2.0 ** -24


def uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for each row's stream at the given token ids.

    keys: [B] int64; token_ids: [B, K] or [K] int64 (vocabulary indices). Returns float32
    [B, K]: 24-bit resolution, never exactly 0 or 1.
    """
    bits = mix64(keys[:, None] + (token_ids + 1) * GAMMA)
    top = _shr(bits, 64 - UNIFORM_BITS)
    return ((top.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))).clamp_(max=U_MAX)


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) for the same indices as :func:`uniforms`: [B, K]
    float32, within about [-2.9, 17.3] (the 24-bit uniform bounds both tails at p < 1e-7)."""
    return -torch.log(-torch.log(uniforms(keys, token_ids)))


def _gumbel_(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """:func:`gumbel` with in-place ops on two scratch tensors (same bits, fewer allocations)."""
    z = keys[:, None] + (token_ids + 1) * GAMMA
    tmp = torch.empty_like(z)
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        z.bitwise_xor_(tmp.bitwise_and_((1 << (64 - shift)) - 1))
        if mul is not None:
            z.mul_(mul)
    torch.bitwise_right_shift(z, 64 - UNIFORM_BITS, out=tmp)
    u = tmp.bitwise_and_((1 << UNIFORM_BITS) - 1).to(torch.float32)
    return u.add_(0.5).mul_(1.0 / (1 << UNIFORM_BITS)).clamp_(max=U_MAX).log_().neg_().log_().neg_()


SLAB_ELEMENTS = 1 << 18  # 2 MiB of int64 scratch: the hash's ~15 passes stay in cache


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, token_ids: torch.Tensor,
                  slab_elements: int = SLAB_ELEMENTS) -> torch.Tensor:
    """argmax(scores + gumbel(keys, token_ids), -1) -> [B] int64 column indices.

    scores: [B, K] float32 (-inf = excluded); token_ids: [K] or [B, K] int64. Computed over
    slabs of rows of at most ``slab_elements`` elements (one row at least): on a CPU a [8, 49152]
    int64 scratch (3 MiB) and its copies fall out of cache and costs several times more per element than a
    slab that stays in it. The result does not depend on the slab size.
    """
    rows = max(1, slab_elements // max(1, scores.shape[-1]))
    if rows >= scores.shape[0]:
        return torch.argmax(scores + _gumbel_(keys, token_ids), dim=-1)
    picks = []
    for r in range(0, scores.shape[0], rows):
        ids = token_ids if token_ids.dim() == 1 else token_ids[r:r + rows]
        picks.append(torch.argmax(scores[r:r + rows] + _gumbel_(keys[r:r + rows], ids), dim=-1))
    return torch.cat(picks)
