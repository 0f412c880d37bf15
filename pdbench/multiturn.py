"""Run multi-turn conversations against a server: turns of one conversation in sequence (turn
*k+1* is built from the text the server answered to turn *k*), conversations concurrent.

Conversation starts follow the arrival process of :mod:`pdbench.runner` (``request_rate`` =
conversations/s, ``max_concurrency`` = conversations in flight). The run is bounded by
``max_duration_s`` (in-flight turns are cancelled, the turns not run are recorded as failed) and
each request by ``request_timeout_s``. A failed turn ends its conversation: its later turns are
recorded as failed too, so every conversation yields exactly ``num_turns`` records.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from .client import RequestOptions, send_request
from .conversations import Conversation, turn_sample
from .metrics import RequestRecord
from .runner import RunSettings, cut_message, dispatch, progress_bar

EARLIER_TURN_FAILED = "an earlier turn of this conversation failed"


async def run_conversation(client: httpx.AsyncClient, conv: Conversation, opts: RequestOptions,
                           out: list[RequestRecord]) -> None:
    """Send the turns of ``conv`` one after another, appending each turn's record to ``out``
    (as it finishes, so a cancelled run keeps the turns done)."""
    answers: list[str] = []
    for _ in conv.user_messages:
        rec = await send_request(client, turn_sample(conv, answers), opts)
        out.append(rec)
        if not rec.ok:
            return
        answers.append(rec.text)


def _complete(conv: Conversation, recs: list[RequestRecord], cut: str) -> list[RequestRecord]:
    """``recs`` padded to one record per turn: turns after a failure, or never started, failed."""
    reason = EARLIER_TURN_FAILED if recs and not recs[-1].ok else cut
    return recs + [RequestRecord(ok=False, error=reason) for _ in range(len(conv.user_messages) - len(recs))]


async def run_conversations(client: httpx.AsyncClient, convs: list[Conversation], opts: RequestOptions,
                            settings: RunSettings, desc: str = "multiturn"
                            ) -> tuple[list[list[RequestRecord]], float]:
    """Run every conversation; return (records per conversation in turn order, duration s)."""
    done: list[list[RequestRecord]] = [[] for _ in convs]

    def job(i: int, conv: Conversation) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await run_conversation(client, conv, opts, done[i])
        return run

    bar = progress_bar(len(convs), settings.progress, desc)
    duration = await dispatch([job(i, c) for i, c in enumerate(convs)], settings, bar)
    cut = cut_message(settings)
    return [_complete(c, recs, cut) for c, recs in zip(convs, done)], duration
