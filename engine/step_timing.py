"""Where wall time goes: cumulative seconds per stage of a repeated loop, by kind of iteration.

One :class:`StageClock` times one loop: :meth:`StageClock.start` at the top of an iteration,
:meth:`StageClock.lap` after each stage (the time since the previous mark goes to that stage),
:meth:`StageClock.commit` at the end adds the iteration to the totals of its kind (a decode step
and a prefill step cost very different amounts, so they are kept apart). The engine times the
stages of a step (``engine.llm_engine.STEP_STAGES``, kinds :data:`STEP_KINDS`) and the engine loop
those of an iteration (``executor.engine_loop.LOOP_STAGES``, kinds :data:`LOOP_KINDS`). Both reach
the stats snapshot and ``/metrics`` (``pdserve_engine_step_stage_seconds``,
``pdserve_engine_loop_stage_seconds``), so the per-token cost of a real server splits without a
profiler (``bench/server_overhead.py``).

Cost: one ``time.perf_counter()`` call (~0.1 us) and one list update per lap. On CUDA a stage's
time is host time: kernels run asynchronously, so ``forward`` is launch time and the wait for the
GPU lands in the stage that first reads a result back (``sample``).
"""
from __future__ import annotations

import time

# A step's kind: every scheduled item computed one token (decode), some item computed more
# (prefill: a prompt or a chunk of one; mixed batches count here), or nothing ran (empty).
STEP_KINDS = ("decode", "prefill", "empty")
# A loop iteration's kind: the kind of the step it ran, or idle when it ran none.
LOOP_KINDS = (*STEP_KINDS, "idle")


def step_kind(new_tokens: list[int]) -> str:
    """The kind of a step whose scheduled items compute ``new_tokens`` tokens each."""
    if not new_tokens:
        return "empty"
    return "decode" if all(k == 1 for k in new_tokens) else "prefill"


class StageClock:
    """Cumulative wall seconds per (kind, stage) and iterations per kind (single-threaded)."""

    def __init__(self, stages: tuple[str, ...], kinds: tuple[str, ...]) -> None:
        """stages: stage names in loop order; kinds: the iteration kinds :meth:`commit` accepts."""
        self.stages, self.kinds = stages, kinds
        self._index = {s: i for i, s in enumerate(stages)}
        self.seconds: dict[str, list[float]] = {k: [0.0] * len(stages) for k in kinds}
        self.counts: dict[str, int] = dict.fromkeys(kinds, 0)
        self._current = [0.0] * len(stages)
        self._mark = time.perf_counter()

    def start(self) -> None:
        """An iteration begins now (forgets any laps not committed)."""
        self._current = [0.0] * len(self.stages)
        self._mark = time.perf_counter()

    def lap(self, stage: str) -> None:
        """Charge the seconds since the last start or lap to ``stage``. Raises KeyError for an unknown stage."""
        now = time.perf_counter()
        self._current[self._index[stage]] += now - self._mark
        self._mark = now

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Recharge ``seconds`` of this iteration from stage ``src`` to ``dst`` (a callee timed a
        part of ``src`` that belongs to ``dst``). Raises KeyError for an unknown stage."""
        self._current[self._index[src]] -= seconds
        self._current[self._index[dst]] += seconds

    def commit(self, kind: str) -> None:
        """Add this iteration's laps to ``kind``'s totals. Raises KeyError for an unknown kind."""
        totals = self.seconds[kind]
        for i, s in enumerate(self._current):
            totals[i] += s
        self.counts[kind] += 1
        self._current = [0.0] * len(self.stages)

    def snapshot(self, prefix: str) -> dict[str, float | int]:
        """Flat stats: ``{prefix}_{kind}_count`` (iterations) and ``{prefix}_{kind}_{stage}_s`` (seconds)
        for every kind that has run at least once."""
        out: dict[str, float | int] = {}
        for kind in self.kinds:
            if not self.counts[kind]:
                continue
            out[f"{prefix}_{kind}_count"] = self.counts[kind]
            out.update({f"{prefix}_{kind}_{stage}_s": round(s, 6)
                        for stage, s in zip(self.stages, self.seconds[kind])})
        return out
