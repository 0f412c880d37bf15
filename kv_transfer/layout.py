"""KV layout descriptor and the pairing check done at every KV handshake.

The wire form is :class:`pdserve.protocol.KVLayoutModel` (one definition for HTTP and transceiver
headers). A mismatch must be refused before any byte moves: copying blocks between different
layouts would make the gen side decode garbage instead of failing.
"""

from __future__ import annotations

import math

from pdserve.protocol import KVLayoutModel as KVLayout

__all__ = ["KVLayout", "KVLayoutMismatch", "check_pairing", "bytes_per_block", "blocks_for_tokens"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Fields that must be equal on both sides (TP size may differ only where a formatter exists).
_PAIRED_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size")


class KVLayoutMismatch(ValueError):
    """The two sides of a KV transfer disagree on the cache layout; the message names both values."""


def check_pairing(local: KVLayout, remote: KVLayout, local_name: str = "gen", remote_name: str = "ctx") -> None:
    """Refuse a transfer between incompatible layouts.

    Raises:
        KVLayoutMismatch: naming every field that differs, e.g.
            ``KV layout mismatch: block_size gen=16 ctx=32``.
    """
    diffs = [f"{f} {local_name}={getattr(local, f)!r} {remote_name}={getattr(remote, f)!r}"
             for f in _PAIRED_FIELDS if getattr(local, f) != getattr(remote, f)]
    if diffs:
        raise KVLayoutMismatch("KV layout mismatch: " + "; ".join(diffs))


def bytes_per_block(layout: KVLayout) -> int:
    """Bytes of one block-major block: layers * 2 (K,V) * block_size * kv_heads * head_dim * itemsize."""
    try:
        item = _DTYPE_BYTES[layout.dtype]
    except KeyError:
        raise KVLayoutMismatch(f"unknown KV dtype {layout.dtype!r}") from None
    return layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * item


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks holding the KV of ``num_tokens`` tokens (ceil division)."""
    return math.ceil(num_tokens / block_size)


_SHARED_FIELDS = ("model", "dtype", "block_size", "num_layers", "head_dim")


def check_tp_pairing(gen: list[KVLayout], ctx: list[KVLayout]) -> None:
    """Refuse a transfer between two TP groups (one layout per rank, rank order) that cannot pair.

    Everything but the head split must match; the total KV heads must be equal (the formatter
    re-slices heads when the TP sizes differ).

    Raises:
        KVLayoutMismatch: naming every field that differs, with both values.
    """
    g, c = gen[0], ctx[0]
    diffs = [f"{f} gen={getattr(g, f)!r} ctx={getattr(c, f)!r}" for f in _SHARED_FIELDS if getattr(g, f) != getattr(c, f)]
    heads_g, heads_c = sum(x.num_kv_heads for x in gen), sum(x.num_kv_heads for x in ctx)
    if heads_g != heads_c:
        diffs.append(f"total num_kv_heads gen={heads_g} ctx={heads_c}")
    if diffs:
        raise KVLayoutMismatch("KV layout mismatch: " + "; ".join(diffs))
