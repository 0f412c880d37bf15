"""The gen phase of an n > 1 request: its n-choice stream, then (a gen server died mid-decode) one
n = 1 continuation per unfinished choice, merged into one client stream (:mod:`orchestrator.choices`).

:class:`ChoicesRelay` has :class:`orchestrator.relay.GenRelay`'s interface (what
:class:`~orchestrator.relay.StreamAnswer` and a non-stream answer use). The n-choice stream runs in
a GenRelay that never migrates; when it breaks and the server looks dead, every choice without a
``finish_reason`` continues in a GenRelay of its own (its source: :class:`ChoiceContinuation`, which
prefills the prompt again and hands its gen server that choice's tokens and ``choice_index``). The
continuations run concurrently as tasks of one :class:`asyncio.TaskGroup` owned by :meth:`run`:
they end with the request's deadline, a failure of any of them (the others are cancelled and the
client gets the error event), or the client leaving (the cancellation reaches the group). Their
chunks reach the client one write at a time (a lock), each with its choice's ``index``.

``migration_limit`` counts per choice: the break of the n-choice stream is each continued choice's
first migration, and a continuation may migrate ``migration_limit - 1`` more times.

A gen server that drains with ``move_kv`` moves a movable n-choice stream choice by choice: its
last event is ``{"moved": {"choices": [params, ...]}}`` (pdserve.protocol.MOVED_CHOICES_KEY), one
lease per unfinished choice (``choice_index``, ``ctx_request_id`` ``"<id>-c<i>"``,
``first_gen_tokens``, ``kv_num_tokens``). Each such choice continues as an n = 1
``generation_only`` pull of its lease on another gen server (:meth:`GenPhase.move
<orchestrator.migration.GenPhase.move>` with the choice's ``choice_index``): the target computes
the one token left and samples on as choice i; nothing is prefilled again (a choice whose tokens
disagree with its lease's is prefilled again instead, its lease released). When a choice could not
be parked the server hands the stream back instead (its last event ``{"moved": {"handed_back":
true}}``: the choices' KV freed): its unfinished choices continue the same way as after a break, on
other gen servers, prefilled again (a recompute). Neither counts toward ``migration_limit``
(nothing failed) and the server is not marked unhealthy. A continuation is an n = 1 stream: a later
drain moves its KV like any n = 1 stream's. A lease whose choice the relay already saw finish is
left to its lease timer (the engine moves unfinished choices only, so none is expected).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.protocol import MOVED_CHOICES_KEY

from . import jsonio
from .choices import ChoicesProgress
from .errors import OrchestratorError
from .metrics import Metrics
from .migration import GenPhase
from .pools import Server
from .progress import Progress
from .relay import Emit, GenRelay, GenSource, GenStream

log = logging.getLogger("orchestrator.choices_relay")

_DEADLINE_GRACE_S = 1.0  # past the request's deadline the streams are cut (their timers); the group then ends


class ChoiceContinuation:
    """A :class:`GenSource` continuing one choice (``phase``: an n = 1 :class:`GenPhase` with the
    choice's Progress and ``choice_index``): its first stream is a migration of that choice, or, when
    the choice has no token yet (colocated n-choice stream), a colocated n = 1 stream of it."""

    def __init__(self, phase: GenPhase, progress: Progress, moved: tuple[dict, Server] | None = None) -> None:
        """``moved``: (this choice's entry of a moved event, the draining gen server that parked it):
        the first stream pulls that lease (a move) instead of prefilling again."""
        self._phase, self._progress, self._moved = phase, progress, moved

    async def first(self) -> GenStream:
        if self._moved is not None:
            entry, source = self._moved
            return await self._phase.move(self._progress, entry, source)
        if self._progress.token_ids:
            return await self._phase.migrate(self._progress)
        return await self._phase.first()

    async def migrate(self, progress: Progress) -> GenStream:
        return await self._phase.migrate(progress)

    async def move(self, progress: Progress, moved: dict, source: Server) -> GenStream:
        return await self._phase.move(progress, moved, source)

    def abandon(self) -> None:
        self._phase.abandon()


def moved_choices(moved: dict) -> dict[int, dict]:
    """choice index -> its lease's params, from a moved event's ``disaggregated_params``-like body
    (``{"choices": [...]}``: pdserve.protocol.MOVED_CHOICES_KEY); {} for a hand-back or anything
    malformed (those choices are prefilled again)."""
    entries = moved.get(MOVED_CHOICES_KEY)
    if not isinstance(entries, list):
        return {}
    out: dict[int, dict] = {}
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("choice_index"), int) and entry.get("ctx_request_id"):
            out[entry["choice_index"]] = entry
    return out


class _ChoiceFailed(Exception):
    """A continuation failed for good (its message is the client's error)."""


class ChoicesRelay:
    """Runs an n > 1 request's gen phase (see the module docstring).

    ``continuation(i, exclude)``: a new n = 1 :class:`GenPhase` for choice ``i`` (its Progress is
    ``progress.choices[i]``) whose first gen stream avoids the gen servers in ``exclude``. Other arguments as :class:`GenRelay`'s.
    """

    def __init__(self, progress: ChoicesProgress, source: GenSource, continuation: Callable[[int, set[str]], GenPhase],
                 migration_limit: int, metrics: Metrics, endpoint: str, deadline_s: float,
                 include_usage: bool) -> None:
        self.progress = progress
        self._continuation = continuation
        self._limit = migration_limit
        self._metrics, self._endpoint, self._deadline_s = metrics, endpoint, deadline_s
        self._include_usage = include_usage
        self._first = GenRelay(progress, source, 0, metrics, endpoint, deadline_s,  # type: ignore[arg-type]
                               include_usage, moves=False)
        self._more: list[GenRelay] = []
        self.finished = False

    @property
    def migrations(self) -> int:
        return len(self._more) + sum(r.migrations for r in self._more)

    @property
    def chunks_sent(self) -> int:
        return self._first.chunks_sent + sum(r.chunks_sent for r in self._more)

    @property
    def t_last(self) -> float | None:
        times = [t for t in [self._first.t_last, *(r.t_last for r in self._more)] if t is not None]
        return max(times) if times else None

    async def run(self, emit: Emit | None) -> str | None:
        """Relay until every choice finished (None) or the request failed (the failure's message).
        Raises OrchestratorError: the n-choice stream could not be opened."""
        failure = await self._first.run(emit)
        if failure is None:
            self.finished = True
            return None
        broken = self._first.broken
        todo = [c.index for c in self.progress.choices if c.finish_reason is None]
        drained = broken is not None and broken.moved is not None and broken.server is not None
        if broken is None or not (broken.migratable or drained) or not self._limit or not todo:
            return failure
        self.progress.continued = True
        moved = moved_choices(broken.moved) if drained and broken.moved is not None else {}
        how = "" if not drained else " (moved by a drain: each pulls its KV)" if moved else \
            " (handed back by a drain: prefilled again)"
        log.warning("%s; continuing %d unfinished choice(s) %s each on another gen server%s", failure, len(todo),
                    todo, how)
        exclude = {broken.server.url} if drained and broken.server is not None else set()
        leases = {i: (moved[i], broken.server) for i in todo if i in moved and broken.server is not None}
        failure = await self._continue(todo, emit, exclude, drained, leases)
        self.finished = failure is None
        return failure

    async def _continue(self, todo: list[int], emit: Emit | None, exclude: set[str], drained: bool,
                        leases: dict[int, tuple[dict, Server]]) -> str | None:
        """Continue choices ``todo`` concurrently (not on the gen servers in ``exclude``; choice i in
        ``leases`` pulls its moved lease); the failure's message, or None when all finished."""
        lock = asyncio.Lock()

        async def one_at_a_time(data: bytes) -> None:
            assert emit is not None
            async with lock:
                await emit(data)

        out = None if emit is None else one_at_a_time
        failures: list[str] = []
        try:
            async with asyncio.timeout(max(self._deadline_s - time.monotonic(), 0.0) + _DEADLINE_GRACE_S):
                try:
                    async with asyncio.TaskGroup() as group:
                        for i in todo:
                            group.create_task(self._one(i, out, exclude, drained, leases.get(i)),
                                              name=f"choice-{i}")
                except* (_ChoiceFailed, OrchestratorError) as err:
                    # the first failure cancelled the other continuations: it is the client's error
                    first = err.exceptions[0]
                    failures.append(first.message if isinstance(first, OrchestratorError) else str(first))
        except TimeoutError:
            return "the request's deadline passed while its choices continued"
        return failures[0] if failures else None

    async def _one(self, i: int, emit: Emit | None, exclude: set[str], drained: bool,
                   lease: tuple[dict, Server] | None) -> None:
        """Continue choice ``i`` to its end (``drained``: after a drain, which is no failure: the
        continuation keeps the whole ``migration_limit``; ``lease``: its moved KV to pull, with the
        server that parked it). Raises _ChoiceFailed, OrchestratorError."""
        progress = self.progress.choices[i]
        source = ChoiceContinuation(self._continuation(i, exclude), progress, lease)
        limit = self._limit if drained else self._limit - 1
        relay = GenRelay(progress, source, max(limit, 0), self._metrics, self._endpoint, self._deadline_s, False)
        self._more.append(relay)
        (self._metrics.moves if lease is not None else self._metrics.migrations).inc()
        try:
            failure = await relay.run(emit)
            if failure is not None:
                raise _ChoiceFailed(f"choice {i}: {failure}")
            tail = relay.take_tail()
            if tail and emit is not None:
                await emit(b"".join(tail))
        finally:
            if not relay.finished:
                source.abandon()

    def take_tail(self) -> list[bytes]:
        """The n-choice stream's last chunks (a continuation writes its own as it ends)."""
        return self._first.take_tail()

    def usage_chunk(self) -> bytes | None:
        """The usage chunk to add at the end: the client wants one and the n-choice stream did not
        send it (it broke, and the request's usage is made here)."""
        if not self._include_usage or (self.progress.usage is not None and not self.progress.continued):
            return None
        if self.progress.head is None:
            return None
        obj = "chat.completion.chunk" if self.progress.chat else "text_completion"
        doc = {**self.progress.head, "object": obj, "choices": [], "usage": self.progress.final_usage()}
        return b"data: " + jsonio.dumps(doc) + b"\n\n"
