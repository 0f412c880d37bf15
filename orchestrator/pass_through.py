"""Pass-through gen streams (``disaggregated_params.relay_head``): reading the records.

A gen server asked for ``relay_head`` writes each chunk as the client gets it (the request's id
and created, no role, no ``token_ids`` field), after a record line
:data:`pdserve.protocol.RELAY_LINE` ``[start, end, [token ids], finish_reason]`` that says where the
chunk's text lies in the output text (characters ``start``..``end``; the output text starts with
``first_gen_tokens``' text) and which tokens it came from; tokens whose text is held back (a
possible stop string, an incomplete UTF-8 character) get a record alone. The relay forwards a
chunk whose text begins where the client's ends as written, record cut off
(:meth:`orchestrator.relay.GenRelay._passed`), and merges the others (the chunk that repeats the
ctx server's first token, a migration target's replay) as any event.

:func:`take_run` reads a whole run of pass-through events of one upstream piece with a few
regular-expression calls (what a relay that fell behind sees: many events per read), so its cost
per event falls as the load rises.
"""

from __future__ import annotations

import re

from pdserve.protocol import RELAY_LINE

from . import jsonio
from .progress import Attempt

# One or more pass-through events: a record line, a data line or none, the blank line.
_RUN = re.compile(rb"(?:" + re.escape(RELAY_LINE) + rb"[^\n]*\n(?:data: [^\n]*\n)?\n)+")
# A record's JSON, and "d" when a data line follows it.
_RECORD = re.compile(re.escape(RELAY_LINE) + rb"([^\n]*)\n(d?)")
# A record line (with the blank line of a record alone): what the client must not see.
_RECORD_LINE = re.compile(re.escape(RELAY_LINE) + rb"[^\n]*\n\n?")


def parse(payload: bytes) -> tuple[int, int, list, str | None, bytes]:
    """One pass-through event (the bytes from its record line to before its blank line):
    ``(start, end, token_ids, finish_reason, data_line)``; ``data_line`` is b"" for a record alone.

    Raises:
        ValueError: the record is not ``[int, int, list, str | None]``, or says there is text
            but no data line follows.
    """
    nl = payload.find(b"\n")
    record = jsonio.loads(payload[len(RELAY_LINE):nl] if nl >= 0 else payload[len(RELAY_LINE):])
    start, end, ids, finish = _checked(record)
    data = payload[nl + 1:] if nl >= 0 else b""
    if not data and end != start:
        raise ValueError("a record of text without its chunk")
    if data and not data.startswith(b"data: "):
        raise ValueError("the record is not followed by a data line")
    return start, end, ids, finish, data


def take_run(raw: bytes, at: int, attempt: Attempt) -> tuple[int, bytes, int] | None:
    """Merge the run of pass-through events that starts at ``raw[at]`` into ``attempt``, when the
    client has no text past this stream's (so every chunk of the run goes out as written).

    Returns ``(end, client_bytes, events)``: where the run ends in ``raw``, its chunks without
    their records, and how many events it held; None when no run starts there (or the client is
    ahead of this stream: the caller merges event by event).

    Raises:
        ValueError: a record is malformed or does not continue the stream's text (nothing of the
            run is merged).
    """
    if attempt.text_len < attempt.p.sent_len:
        return None
    found = _RUN.match(raw, at)
    if found is None:
        return None
    end = found.end()
    pairs = _RECORD.findall(raw, at, end)
    records = jsonio.loads(b"[" + b",".join([r for r, _ in pairs]) + b"]")
    attempt.take_run([_checked(r) for r in records], [bool(d) for _, d in pairs])
    return end, _RECORD_LINE.sub(b"", raw[at:end]), len(pairs)


def _checked(record: object) -> tuple[int, int, list, str | None]:
    if type(record) is not list or len(record) != 4:
        raise ValueError("a record is not [start, end, [token ids], finish_reason]")
    start, end, ids, finish = record
    if type(start) is not int or type(end) is not int or type(ids) is not list or (
            finish is not None and type(finish) is not str):
        raise ValueError("a record is not [start, end, [token ids], finish_reason]")
    return start, end, ids, finish
