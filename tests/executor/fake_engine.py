"""A scripted engine and role for engine-loop tests, and a harness that runs them on either transport.

``FakeEngine`` has the loop-facing surface of :class:`engine.llm_engine.LLMEngine`: each request
emits one token per step until ``max_tokens``; a ``generation_only`` request first asks for a KV
pull and waits for ``kv_ready``; ``hold`` makes every waiting request unschedulable (the engine
has work but cannot make progress: its steps are ``stalled``). ``FakeRole`` delivers a
:class:`Marker` before a ``ctx-`` request's final output (as the ctx role's KVHandoff does) and
runs pulls on its own thread (as the gen role does).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass

from engine.errors import RequestValidationError
from engine.kv_event_log import KVEventLog
from engine.request import EngineRequest, KVPull, Phase, RequestOutput, StepResult
from engine.sampling_params import SamplingParams
from executor.engine_loop import EngineLoop
from executor.ipc import Codec, new_key
from executor.kv_role import RankShards, WorkerRole
from executor.phases import PhaseError


@dataclass
class Marker:
    """A role item for a request's stream (stands in for KVHandoff / KVTransferDone)."""

    request_id: str
    what: str


def request(rid: str, n: int = 3, phase: Phase = Phase.CONTEXT_AND_GENERATION, prompt=(5, 6, 7)) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0), phase=phase,
                         first_token_ids=[1] if phase is Phase.GENERATION_ONLY else None)


class FakeEngine:
    kv_cache = None
    max_model_len = 64
    tokenizer = None

    def __init__(self) -> None:
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[str, list] = {}     # request id -> [request, tokens emitted]
        self.pulling: dict[str, EngineRequest] = {}
        self._to_emit: list[RequestOutput] = []
        self.hold = False
        self.fail_step = False
        self.steps = 0
        self.threads: set[int] = set()         # every thread that called into the engine
        self.aborted: list[str] = []
        self.kv_events = KVEventLog("fake-epoch")  # a test records into it; the loop takes batches
        self.held_hashes: list[bytes] = []      # what kv_snapshot reports

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, req: EngineRequest) -> None:
        self._touch()
        if not req.prompt_token_ids:
            raise RequestValidationError("the prompt is empty")
        self.waiting.append(req)

    def abort_request(self, rid: str) -> None:
        self._touch()
        self.aborted.append(rid)
        req = self.pulling.pop(rid, None) or (self.running.pop(rid, [None])[0])
        for w in list(self.waiting):
            if w.request_id == rid:
                self.waiting.remove(w)
                req = w
        if req is not None:
            self._to_emit.append(_output(req, 0, True, "abort"))

    def kv_ready(self, rid: str, ok: bool) -> None:
        self._touch()
        req = self.pulling.pop(rid, None)
        if req is None:
            return
        if ok:
            self.running[rid] = [req, 0]
        else:
            self._to_emit.append(_output(req, 0, True, "abort"))

    def release_parked(self, rid: str) -> bool:
        return False

    def reset_prefix_cache(self) -> int:
        self.kv_events.cleared()
        dropped, self.held_hashes = len(self.held_hashes), []
        return dropped

    def take_kv_events(self):
        return self.kv_events.take()

    def kv_snapshot(self):
        return self.kv_events.snapshot(list(self.held_hashes))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_emit)

    def close(self) -> None:
        """LLMEngine.close joins the engine's threads; this engine has none."""

    def stats(self) -> dict:
        return {"free_blocks": 10, "total_blocks": 10, "waiting_requests": len(self.waiting)}

    def step(self) -> StepResult:
        self._touch()
        if self.fail_step:
            raise RuntimeError("simulated kernel failure")
        self.steps += 1
        had_running = bool(self.running)
        outputs, self._to_emit = self._to_emit, []
        pulls = []
        while self.waiting and not self.hold:
            req = self.waiting.popleft()
            if req.phase is Phase.GENERATION_ONLY:
                self.pulling[req.request_id] = req
                pulls.append(KVPull(req.request_id, [0], len(req.prompt_token_ids)))
            else:
                self.running[req.request_id] = [req, 0]
        for rid, entry in list(self.running.items()):
            entry[1] += 1
            done = entry[1] >= entry[0].sampling.max_tokens
            outputs.append(_output(entry[0], entry[1], done, "length" if done else None))
            if done:
                del self.running[rid]
        return StepResult(outputs, pulls, stalled=not (had_running or outputs or pulls))


def _output(req: EngineRequest, token: int, finished: bool, reason: str | None) -> RequestOutput:
    parked = [0] if finished and req.phase is Phase.CONTEXT_ONLY and reason == "length" else None
    return RequestOutput(req.request_id, [token] if token else [], str(token), finished, reason,
                         len(req.prompt_token_ids), token, parked_block_ids=parked)


class FakeRole(WorkerRole):
    """ctx-like hand-off markers, gen-like pulls on a thread (``gen-fail-*`` pulls fail)."""

    name = "fake"

    def __init__(self, pull_s: float = 0.05) -> None:
        self.pull_s = pull_s
        self.submitted: list[str] = []
        self.stopped = False
        self._threads: list[threading.Thread] = []

    def start(self, engine, ops, shards) -> None:
        self.ops = ops

    def on_submit(self, req, disagg) -> None:
        self.submitted.append(req.request_id)

    def on_output(self, out: RequestOutput) -> None:
        if out.finished and out.request_id.startswith("ctx-"):
            self.ops.deliver(out.request_id, Marker(out.request_id, "handoff"))

    def on_pull(self, pull: KVPull) -> None:
        t = threading.Thread(target=self._pull, args=(pull.request_id,), daemon=True)
        self._threads.append(t)
        t.start()

    def _pull(self, rid: str) -> None:
        time.sleep(self.pull_s)
        ok = not rid.startswith("gen-fail-")
        self.ops.deliver(rid, Marker(rid, "kv-done") if ok else PhaseError("KV pull failed", 502, "kv_transfer_error"))
        self.ops.post(lambda engine: engine.kv_ready(rid, ok))

    def release(self, ctx_request_id: str) -> bool:
        return ctx_request_id == "parked-1"

    def stats(self) -> dict:
        return {"role": "fake"}

    def stop(self) -> None:
        for t in self._threads:
            t.join(2.0)
        self.stopped = True


class Harness:
    """Runs an EngineLoop with a FakeEngine/FakeRole behind a real EngineClient on one transport.

    ``queue``: :class:`executor.inproc_executor.InProcessExecutor`. ``lanes``: the zmq lanes of the
    lattice (:class:`executor.lane_transport.LaneTransport` + :class:`executor.lattice_client.LatticeClient`),
    rank 0's loop in a thread of this process.
    """

    def __init__(self, kind: str, idle_wait_s: float = 0.1) -> None:
        self.kind, self.idle_wait_s = kind, idle_wait_s
        self.engine, self.role = FakeEngine(), FakeRole()
        self.client = None
        self._thread: threading.Thread | None = None

    async def __aenter__(self) -> "Harness":
        shards = RankShards([None], [])
        if self.kind == "queue":
            from executor.inproc_executor import InProcessExecutor

            self.client = InProcessExecutor(self.engine, self.role, shards, idle_wait_s=self.idle_wait_s)
            self.client.start()
            return self
        from executor.lane_transport import LaneTransport
        from executor.lattice_client import LatticeClient
        from executor.monitor import proc_start_time
        from executor.proxy import AttachInfo

        self.ipc = tempfile.mkdtemp(prefix="pdl-", dir="/tmp")
        key = new_key()
        ingress, lane = f"ipc://{self.ipc}/in", f"ipc://{self.ipc}/lane0"
        self.transport = LaneTransport(Codec(key), ingress, [lane])
        loop = EngineLoop(self.engine, self.role, self.transport, shards, idle_wait_s=self.idle_wait_s)
        self._thread = threading.Thread(target=loop.run_or_report, args=("fake rank 0",), daemon=True)
        self._thread.start()
        me = {"rank": 0, "pid": os.getpid(), "start_time": proc_start_time(os.getpid())}
        info = AttachInfo(ipc_dir=self.ipc, key_hex=key.hex(), ingress_addr=ingress, lane_addrs=[lane], ranks=[me],
                          worker_info={"max_model_len": 64})
        self.client = LatticeClient(info, tokenizer=None)
        self.client.start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.kind == "queue":
            await self.client.shutdown()
            return
        if self.client.state.value != "dead":
            self.client.send_engine_shutdown()
        await asyncio.to_thread(self._thread.join, 5.0)
        assert not self._thread.is_alive(), "the engine loop did not stop on Shutdown"
        self.transport.close()
        await self.client.shutdown()
        shutil.rmtree(self.ipc, ignore_errors=True)


async def collect(client, req: EngineRequest, disagg=None) -> list:
    """Every item of a request's stream, in order (raises what the stream raises)."""
    return [item async for item in client.generate(req, disagg)]
