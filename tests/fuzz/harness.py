"""What a correct server answers to a fuzz case, and a runner that sends cases and checks answers.

:func:`check` judges one answer (status, headers, body) against its :class:`~tests.fuzz.bodies.Case`:
never a 5xx; a 4xx carries exactly the OpenAI error body ``{"error": {"message", "type", "param",
"code"}}`` and no traceback; a 200 is a complete answer (JSON with one choice, or an SSE stream
that ends with ``data: [DONE]`` and carries no error event). :func:`run_cases` sends cases through
any async ``send`` (ASGI in-process or a socket), bounds each one in time, and every
``probe_every`` cases (and at the end) checks that a valid greedy request still answers exactly
what it answered first.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tests.fuzz.bodies import ACCEPT, COMPLETIONS, REJECT, Case, dumps

ERROR_KEYS = {"message", "type", "param", "code"}
CASE_TIMEOUT_S = 20.0  # generous: the machine is shared; a case takes milliseconds alone


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


Send = Callable[[str, bytes, dict[str, str]], Awaitable[Answer]]


def probe_request(model: str) -> tuple[str, bytes]:
    """A valid greedy request whose answer must never change during a run."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return COMPLETIONS, dumps(body)


def error_problem(body: bytes) -> str | None:
    """Why ``body`` is not an OpenAI error body (None if it is one)."""
    if b"Traceback" in body:
        return "traceback in the body"
    try:
        data = json.loads(body)
    except ValueError:
        return "error body is not JSON"
    if not isinstance(data, dict) or set(data) != {"error"} or not isinstance(data["error"], dict):
        return "error body is not {'error': {...}}"
    err = data["error"]
    if set(err) != ERROR_KEYS:
        return f"error keys {sorted(err)} != {sorted(ERROR_KEYS)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return "error message/type missing"
    return None


def answer_problem(headers: dict[str, str], body: bytes) -> str | None:
    """Why a 200 answer is incomplete (None if it is a whole JSON answer or SSE stream)."""
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in body.split(b"\n\n") if e.strip()]
        if not events or events[-1].strip() != b"data: [DONE]":
            return "stream does not end with [DONE]"
        for e in events[:-1]:
            data = json.loads(e.removeprefix(b"data: "))
            if "error" in data:
                return f"error event in a 200 stream: {data['error']}"
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return "200 body is not JSON"
    if not isinstance(data.get("choices"), list) or len(data["choices"]) != 1:
        return "200 body has no single choice"
    return None


def check(case: Case, answer: Answer) -> str | None:
    """The problem with ``answer`` to ``case``, or None if it is what a correct server answers."""
    status = answer.status
    if status >= 500:
        return f"{status}: {answer.body[:300]!r}"
    if case.expect == REJECT and not 400 <= status < 500:
        return f"expected a 4xx, got {status}: {answer.body[:200]!r}"
    if case.expect == ACCEPT and status != 200:
        return f"expected 200, got {status}: {answer.body[:300]!r}"
    if 400 <= status < 500:
        return error_problem(answer.body)
    if status == 200:
        return answer_problem(answer.headers, answer.body)
    return f"unexpected status {status}"


def probe_text(answer: Answer) -> str:
    """The text of a probe answer. Raises AssertionError if it is not a 200 completion."""
    assert answer.status == 200, f"probe answered {answer.status}: {answer.body[:300]!r}"
    return json.loads(answer.body)["choices"][0]["text"]


@dataclass
class Report:
    """What one run saw: failures (case, problem), counts per status, the slowest case."""

    failures: list[tuple[Case, str]] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    probes: int = 0

    def summary(self, limit: int = 15) -> str:
        lines = [f"{len(self.failures)} failures; statuses {dict(sorted(self.statuses.items()))}; "
                 f"slowest case {self.slowest_s:.2f} s; {self.probes} probes"]
        for case, problem in self.failures[:limit]:
            lines.append(f"  #{case.index} {case.cls} ({case.note}): {problem}")
        return "\n".join(lines)


async def run_cases(send: Send, cases: list[Case], model: str, *, probe_every: int = 100,
                    after: Callable[[Case, Answer], Awaitable[None]] | None = None,
                    timeout_s: float = CASE_TIMEOUT_S) -> Report:
    """Send every case, check each answer and probe a valid request every ``probe_every`` cases.

    ``after(case, answer)`` runs after each case (e.g. releasing a ctx lease). A case that takes
    longer than ``timeout_s`` is a failure ("hang"); so is a probe whose text changed.
    """
    report = Report()
    path, probe_body = probe_request(model)
    reference = probe_text(await asyncio.wait_for(send(path, probe_body, {"content-type": "application/json"}), timeout_s))
    for case in cases:
        t0 = time.perf_counter()
        try:
            answer = await asyncio.wait_for(send(case.path, case.body, case.headers), timeout_s)
        except TimeoutError:
            report.failures.append((case, f"no answer within {timeout_s} s"))
            continue
        report.slowest_s = max(report.slowest_s, time.perf_counter() - t0)
        report.statuses[answer.status] = report.statuses.get(answer.status, 0) + 1
        if (problem := check(case, answer)) is not None:
            report.failures.append((case, problem))
        if after is not None:
            await after(case, answer)
        if (case.index + 1) % probe_every == 0 or case is cases[-1]:
            got = probe_text(await asyncio.wait_for(send(path, probe_body, {"content-type": "application/json"}),
                                                    timeout_s))
            report.probes += 1
            if got != reference:
                report.failures.append((case, f"probe after this case answered {got!r}, first {reference!r}"))
    return report
