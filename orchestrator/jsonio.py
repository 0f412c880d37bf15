"""JSON in and out of the orchestrator's hot path, with the semantics of the stdlib kept where
faster libraries differ.

* :func:`loads` (servers' answers): orjson. The servers are ours and write plain JSON.
* Client bodies are not parsed here: :mod:`pdserve.request_body` (strict JSON, shared with the
  servers) does that, with the stdlib, whose big integers stay ``int`` (orjson turns those past
  64 bits into floats).
* :func:`dumps`: orjson; an integer past 64 bits (orjson refuses it) falls back to the stdlib.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

Fragment = orjson.Fragment  # pre-encoded JSON embedded as is by dumps


def loads(raw: bytes) -> Any:
    """Parse a server's answer. Raises ValueError (orjson.JSONDecodeError) on bad JSON."""
    return orjson.loads(raw)


def dumps(doc: Any) -> bytes:
    """Compact UTF-8 JSON of ``doc`` (dicts, lists, str, int, float, bool, None, Fragment)."""
    try:
        return orjson.dumps(doc)
    except orjson.JSONEncodeError:
        # Integers beyond 64 bits (a client may send them; validation decides) and nothing else
        # that a parsed body can hold; Fragments never reach this path in practice.
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
