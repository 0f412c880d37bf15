"""Join-time KV layout check: may a ctx server and a gen server ever exchange KV blocks?

The orchestrator runs this when a server joins a pool (its ``/server_info`` or registration body
carries ``kv_layout``, :class:`pdserve.protocol.KVLayoutModel` as a dict). It must stay importable
without torch or :mod:`kv_transfer`; the per-request handshake is
:func:`kv_transfer.layout.check_pairing`, which also sees every TP rank's layout.

Compared here (fields missing on either side are skipped):

* ``model``, ``dtype``, ``block_size``, ``num_layers``, ``head_dim``: always.
* the total KV heads: ``total_kv_heads`` when both sides have it (:func:`join_layout` adds it
  from a server's ``kv_layouts``, one per TP rank); else ``num_kv_heads`` only when both sides
  have the same ``tp_size``. That is the head count of one rank (rank 0), so with different TP
  sizes it differs legitimately (the KV formatter splits or concatenates heads), and an uneven
  split makes ``num_kv_heads * tp_size`` wrong as a total. With equal TP sizes equal totals give
  equal rank-0 counts, so a difference is a real mismatch.
* ``tp_size`` itself is not compared: a formatter exists for ctx TP != gen TP.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["JOIN_FIELDS", "join_layout", "join_mismatch"]

JOIN_FIELDS = ("model", "dtype", "block_size", "num_layers", "head_dim", "total_kv_heads", "num_kv_heads")


def join_layout(kv_layout: Mapping, kv_layouts: object = None) -> dict:
    """``kv_layout`` (rank 0) plus ``total_kv_heads`` when ``kv_layouts`` lists every TP rank."""
    out = dict(kv_layout)
    if (isinstance(kv_layouts, list) and kv_layouts and len(kv_layouts) == out.get("tp_size", 1)
            and all(isinstance(x, Mapping) and isinstance(x.get("num_kv_heads"), int) for x in kv_layouts)):
        out["total_kv_heads"] = sum(x["num_kv_heads"] for x in kv_layouts)
    return out


def _plain(value: object) -> str:
    """A value as the message shows it: strings bare (``dtype gen=float32``), others as repr."""
    return value if isinstance(value, str) and value and not any(c.isspace() for c in value) else repr(value)


def join_mismatch(a: Mapping, b: Mapping, a_name: str = "gen", b_name: str = "ctx") -> str | None:
    """``None`` when layouts ``a`` and ``b`` may pair, else a message naming both values of every
    field that differs, e.g. ``KV layout mismatch: block_size gen=32 ctx=16`` or
    ``KV layout mismatch: dtype gen=float32 ctx=bfloat16`` (the dtype each server resolved)."""
    diffs = []
    for f in JOIN_FIELDS:
        if f not in a or f not in b:
            continue
        if f == "num_kv_heads" and ("total_kv_heads" in a and "total_kv_heads" in b
                                    or a.get("tp_size", 1) != b.get("tp_size", 1)):
            continue
        if a[f] != b[f]:
            diffs.append(f"{f} {a_name}={_plain(a[f])} {b_name}={_plain(b[f])}")
    return "KV layout mismatch: " + "; ".join(diffs) if diffs else None
