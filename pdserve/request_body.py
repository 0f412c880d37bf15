"""A client's request body, from raw bytes to a validated OpenAI request model; shared by every app.

The orchestrator and the ctx/gen servers read bodies the same way, so that a body one of them
accepts the others accept too, and no input reaches code that was not written for it:

1. :func:`read_limited` reads at most :data:`MAX_BODY_BYTES` (413 past it; the connection is then
   closed, since the rest of the body is never read).
2. :func:`decode_json` parses strict JSON (RFC 8259): UTF-8 only, no ``NaN``/``Infinity`` literals, no number
   that overflows a double (``1e309``), no integer longer than Python's 4,300-digit limit, no
   nesting deeper than :data:`MAX_JSON_DEPTH`, no lone UTF-16 surrogate (``"\\ud800"``, valid
   JSON text but not Unicode, which the tokenizer and every UTF-8 encoder refuse), top level an
   object. Each is a 400. The common body is parsed by orjson (several times faster), only where
   its result is the stdlib's: orjson refuses every input above but the long integers, which it
   would turn into floats, so a body with a run of 19 digits, or one orjson refuses, is parsed
   by the stdlib as before (the same value, or the same error message).
3. :func:`validate_request` checks the body against a pydantic model (422 naming the field path).

Every failure is a :class:`BodyError` carrying the HTTP status, the message and the OpenAI
``param``. Imports only pydantic and orjson (the orchestrator never imports torch).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import orjson
from pydantic import BaseModel, ValidationError

# 32 MiB. The largest valid request is far smaller: a prompt filling a 128k-token context window
# is ~1 MiB as token ids and ~0.5-2 MiB as text, and tool or JSON-schema definitions add kilobytes.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Containers inside containers. A request nests ~5 deep (body → messages → [i] → content → [j]
# → part); JSON schemas a few dozen. Past this, later encoders could hit Python's recursion limit.
MAX_JSON_DEPTH = 128

_CONTAINERS = {dict, list}
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# A surrogate can only come from a \\uD800-\\uDFFF escape (strict UTF-8 refuses encoded ones).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Every integer orjson could turn into a float (past 64 bits) holds a run of at least 19 digits:
# with each digit mapped to b"0" and every other byte to b" ", a run is a substring search (C
# speed: ~10x a regex search).
_DIGITS_TO_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * 19


class BodyError(ValueError):
    """A body refused with HTTP ``status`` (400, 413 or 422) and an OpenAI error ``param``.

    ``close_connection`` is set when the server did not read the whole body (413): the rest of it
    is still on the wire, so the connection cannot carry another request.
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.close_connection = status == 413


class StreamingRequest(Protocol):
    """What :func:`read_limited` needs of a request (starlette's ``Request`` has it)."""

    headers: Mapping[str, str]

    def stream(self) -> AsyncIterator[bytes]: ...


async def read_limited(request: StreamingRequest, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, at most ``limit`` bytes. Raises BodyError 413 past it.

    A ``Content-Length`` over the limit is refused before reading a byte; a chunked body is
    counted as it arrives and refused as soon as it passes the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"request body of {int(declared)} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> float:
    raise BodyError(400, f"request body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise BodyError(400, f"request body has a number out of range: {text[:40]}")
    return value


def decode_json(raw: bytes) -> dict:
    """Parse a body as one strict JSON object (see the module docstring). Raises BodyError 400."""
    body = _decode_fast(raw)
    if body is not None:
        if not isinstance(body, dict):
            raise BodyError(400, f"request body must be a JSON object, got {type(body).__name__}")
        check_tree(body, strings=False)  # orjson refuses lone surrogates; the depth is still checked
        return body
    try:
        # Strict UTF-8 (RFC 8259 §8.1): json.loads(bytes) would also take UTF-16/32 and pass
        # UTF-8-encoded surrogates through ("surrogatepass").
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError; integers over 4,300 digits
        raise BodyError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"request body must be a JSON object, got {type(body).__name__}")
    check_tree(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _decode_fast(raw: bytes) -> object:
    """orjson's parse of ``raw`` where it is the stdlib's (see the module docstring); None: use the stdlib.

    orjson already refuses what :func:`decode_json` refuses (invalid UTF-8, a BOM, ``NaN``/
    ``Infinity``, a double overflow, lone surrogates, control characters, extra data); it turns
    integers past 64 bits into floats, so a body that could hold one is left to the stdlib."""
    if _LONG_RUN in raw.translate(_DIGITS_TO_ZERO):
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None  # the stdlib gives the error (and its message)


def check_tree(body: dict, strings: bool = True) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and (``strings``) lone surrogates.

    Iterative (a recursive walk would itself overflow). A list without containers (token ids) is
    skipped at C speed. Raises BodyError 400.
    """
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BodyError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        items = node.values() if isinstance(node, dict) else node
        if strings:
            _check_strings(node.keys() if isinstance(node, dict) else ())
            _check_strings(items)
        if isinstance(node, list) and not _CONTAINERS.intersection(map(type, node)):
            continue
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))


def _check_strings(values) -> None:
    for v in values:
        if isinstance(v, str) and _LONE_SURROGATE.search(v):
            raise BodyError(400, "request body has a string with a lone UTF-16 surrogate (not Unicode text)")


def loc_path(loc: tuple | list) -> str:
    """``("body", "messages", 0, "role")`` → ``messages.0.role``."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "<body>"


def validation_message(err: ValidationError | list[dict]) -> tuple[str, str | None]:
    """One ``path: problem`` line per error, and the first error's path (the OpenAI ``param``)."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    lines, first = [], None
    for e in errors:
        path = loc_path(e.get("loc", ()))
        msg = "unknown field" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
        lines.append(f"{path}: {msg}")
        first = first or path
    return "; ".join(lines) or "invalid request body", first


def validate_request(body: dict, model: type[BaseModel]) -> BaseModel:
    """``model.model_validate(body)``; raises BodyError 422 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        message, param = validation_message(err)
        raise BodyError(422, message, param) from None
