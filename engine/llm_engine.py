"""LLMEngine: the single-threaded facade (add_request / step / abort / KV hand-off)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

import torch

from engine.block_manager import BlockManager
from engine.choices import Families, fork
from engine.config import check_engine_config
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestValidationError
from engine.kv_connector import HANDED_BACK, MOVED, make_connector
from engine.kv_event_log import KVEventLog
from engine.kv_memory import allocate_kv_cache
from engine.kv_sizing import resolve_num_kv_blocks
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.logprobs import TokenLogprob
from engine.request import EngineRequest, MovedKV, Phase, RequestOutput, StepResult
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus, Sequence
from engine.step_timing import STEP_KINDS, StageClock, step_kind
from engine.structured_output import GrammarCompiler, GrammarError
from engine.tokenizer import Tokenizer
from engine.tp import (EXTRA, NO_TP, RUN, STOP, PlanBroadcaster, TPContext, TPMessage, barrier,
                       broadcast_message)
from engine.validation import validate_request
from pdserve.block_hash import BlockHasher
from pdserve.config import EngineSettings
from pdserve.kv_events import KVEventBatch, KVSnapshot

log = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.01  # an idle step waits this long for the grammar library's vocabulary view
# The stages of step() timed by step_clock: scheduling (grammar waiters included), the plan and its
# input tensors, the model forward (with the TP plan broadcast), sampling (prompt logprobs
# included), applying the tokens (stop checks, detokenization) and building the outputs.
STEP_STAGES = ("schedule", "plan", "forward", "sample", "outputs")


class LLMEngine:
    """One model, one paged KV cache, one scheduler. Call every method from one thread.

    kv_cache: [num_kv_blocks, num_layers, 2 (K, V), block_size, local_kv_heads, head_dim],
    allocated once and never replaced: other threads may copy parked / KVPull blocks while step()
    runs. local_kv_heads == num_kv_heads without TP; with TP the rank's heads are
    tp.kv_head_range(num_kv_heads, rank, size).

    Tensor parallel (tp.size > 1): every rank builds an LLMEngine with its TPContext. Rank 0 is
    used exactly as without TP (it also broadcasts each step's plan); the other ranks call
    run_follower(), and hold no tokenizer, scheduler or block manager.
    """

    def __init__(self, config: EngineSettings, model: str, tp: TPContext | None = None, *,
                 served_model_name: str | None = None, kv_cache_file: str | None = None,
                 kv_connector: str = "disagg"):
        """Load weights and tokenizer, allocate the KV cache.

        config: the server's engine settings whole (pdserve.config.EngineSettings), ``dtype`` and
            ``device`` resolved (engine.config.check_engine_config); kept as ``self.config`` with
            ``num_kv_blocks`` sized (engine.kv_sizing).
        model: "smollm2" alias, path to a .gguf file, or a HF directory (config.json + *.safetensors).
        served_model_name: the model id in block hashes (pdserve.block_hash; the servers pass the
            topology's model.name, as the KV layout does); None = ``model``.
        kv_cache_file: back the KV cache by this file (shared memory another process maps: TP followers).
        kv_connector: "disagg" (context_only requests park their blocks, generation_only ones load
            theirs, engine.kv_connector) or "none" (colocated requests only; the others are refused).

        Raises FileNotFoundError/ValueError (also when the model's KV heads cannot be split over tp.size).
        """
        t0 = time.perf_counter()
        check_engine_config(config, model, kv_connector)
        block_namespace = served_model_name or model
        self.tp = tp or NO_TP
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.device != "cpu":
            torch.cuda.set_device(torch.device(config.device))  # NCCL and default streams follow it
        dtype = getattr(torch, config.dtype)
        model, path = load_model(model, dtype, self.tp, config.device, pack_cpu_linears=config.pack_cpu_linears,
                                 cpu_kernels=config.cpu_kernels)
        self.model_config = model.config
        self.local_kv_heads = model.shard.num_kv_heads
        mc = model.config
        # num_kv_blocks None: sized now, after the weights are on the device (engine.kv_sizing)
        config = config.model_copy(update={"num_kv_blocks": resolve_num_kv_blocks(config, mc, self.local_kv_heads)})
        self.config = config
        self.kv_cache = allocate_kv_cache((config.num_kv_blocks, mc.num_layers, 2, config.block_size,
                                            self.local_kv_heads, mc.head_dim), dtype, kv_cache_file,
                                           config.kv_cache_huge_pages, config.device)
        self.runner = ModelRunner(model, self.kv_cache, config.block_size,
                                  Sampler(model.config.eos_token_ids), config.device)
        self._plans: PlanBroadcaster | None = None
        if not self.tp.is_driver:
            barrier(self.tp, startup=True)  # rank 0 loads a tokenizer too: wait for it here, not for a plan
            log.info("engine TP rank %d/%d loaded %s (%s) in %.2f s", self.tp.rank, self.tp.size,
                     path, config.dtype, time.perf_counter() - t0)
            return
        self.tokenizer = Tokenizer.from_model_path(path, model.config.eos_token_ids)
        self.max_model_len = self._max_model_len()
        self.kv_events = KVEventLog()  # rank 0 only: it owns the block manager
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, self.kv_events)
        self.hasher = BlockHasher(block_namespace, config.dtype, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager,
                                   make_connector(kv_connector, self.block_manager),
                                   model.config.sliding_window)
        self.output_processor = OutputProcessor(self.tokenizer.eos_token_ids, self.max_model_len)
        # structured output: the grammar library's view of the vocabulary is built on first use, once
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.tokenizer.eos_token_ids)
        self._to_emit: dict[tuple[str, int], Sequence] = {}  # (request id, choice index) -> sequence
        self.prefill_tokens = 0  # prompt tokens computed (not cached, not pulled); a recompute counts again
        self.tokens_computed = 0  # tokens whose KV the model computed here (prefill and decode), all requests
        self.requests_moved_out = 0
        self.requests_handed_back = 0
        self.families = Families()  # n > 1 requests after their fork (engine.choices)
        self.step_clock = StageClock(STEP_STAGES, STEP_KINDS)  # where a step's wall time goes (stats: step_*)
        self._pending_copies: list[tuple[int, int]] = []  # fork block copies the TP followers still owe
        self._grammar_wait: list[Sequence] = []  # structured-output requests before the grammar library is ready
        if self.tp.enabled:
            barrier(self.tp, startup=True)
            self._plans = PlanBroadcaster(self.tp)
        log.info("engine loaded %s (%s) in %.2f s", path, config.dtype, time.perf_counter() - t0)

    def _max_model_len(self) -> int:
        cache_tokens = self.config.num_kv_blocks * self.config.block_size
        wanted = self.config.max_model_len or self.model_config.max_position_embeddings
        if wanted > cache_tokens:
            log.warning("max_model_len %d capped to the KV cache size %d tokens",
                        wanted, cache_tokens)
        return min(wanted, cache_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def stats(self) -> dict[str, int]:
        """Block and scheduler counts: ``free_blocks`` (no request references them; cached ones
        included), ``total_blocks``, ``prefill_tokens`` (prompt tokens this engine computed: neither
        cached nor pulled; a recompute after preemption counts again), :meth:`memory_stats`,
        :meth:`Scheduler.counts`, :meth:`Scheduler.prefix_cache_stats` and the step clock
        (``step_<kind>_count``, ``step_<kind>_<stage>_s``: steps and cumulative wall seconds per
        STEP_STAGES stage, by engine.step_timing.STEP_KINDS kind)."""
        return {"free_blocks": self.num_free_blocks, "total_blocks": self.config.num_kv_blocks,
                "prefill_tokens": self.prefill_tokens,
                "tokens_computed": self.tokens_computed, "requests_moved_out": self.requests_moved_out,
                "requests_handed_back": self.requests_handed_back,
                **self.memory_stats(), **self.scheduler.counts(), **self.scheduler.prefix_cache_stats(),
                **self.step_clock.snapshot("step")}

    def memory_stats(self) -> dict[str, int]:
        """``kv_cache_bytes`` (this rank's cache) and, on CUDA, ``device_memory_used_bytes`` (what
        torch's allocator holds on the device: weights, KV cache, live activations; no host sync)."""
        out = {"kv_cache_bytes": self.kv_cache.nbytes}
        if self.kv_cache.is_cuda:
            out["device_memory_used_bytes"] = int(torch.cuda.memory_allocated(self.kv_cache.device))
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash; returns how many unreferenced cached blocks were freed."""
        return self.block_manager.reset_prefix_cache()

    def take_kv_events(self) -> KVEventBatch | None:
        """What the prefix cache stored/removed since the last call, as the next numbered batch
        (None: nothing). The engine loop calls it once per iteration (:mod:`pdserve.kv_events`)."""
        return self.kv_events.take()

    def kv_snapshot(self) -> KVSnapshot:
        """Every cached block hash, valid at the last batch taken. Raises RuntimeError when events
        are pending (take them first, so they are not lost)."""
        return self.kv_events.snapshot(self.block_manager.held_hashes())

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. Raises RequestValidationError when it cannot be served.

        A request without a seed gets a random 63-bit one here: sampling is always keyed by
        (seed, choice, position), see engine.sampler."""
        if self._in_use(req.request_id):
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        validate_request(req, self.max_model_len, self.model_config.vocab_size)
        if req.phase is not Phase.CONTEXT_AND_GENERATION and self.scheduler.connector is None:
            raise RequestValidationError(f"this engine has no KV connector (kv_connector 'none'): "
                                         f"{req.phase.value} requests are refused")
        if req.sampling.seed is None:  # one sampling path: an unseeded request gets a random seed
            req = dataclasses.replace(
                req, sampling=dataclasses.replace(req.sampling, seed=secrets.randbits(63)))
        detok = IncrementalDetokenizer(self.tokenizer)
        chain = self.hasher.chain(req.cache_salt) if self.config.enable_prefix_caching else None
        seq = Sequence(req, detok, chain)
        if req.sampling.structured_output is not None:  # GENERATION_ONLY's first tokens: at kv_ready
            try:
                self.grammars.compile(req.sampling.structured_output)  # cached; no vocabulary needed
            except GrammarError as e:
                raise RequestValidationError(f"request {req.request_id}: {e}") from None
            self.grammars.warm_up()
            if not self.grammars.wait_ready(0.0):  # the first one: the vocabulary view is being built
                self._grammar_wait.append(seq)
                return
            self._attach_grammar(seq)
        self.scheduler.add(seq)

    def _attach_grammar(self, seq: Sequence) -> None:
        try:
            seq.grammar = self.grammars.matcher(seq.sampling.structured_output)
        except GrammarError as e:
            raise RequestValidationError(f"request {seq.request_id}: {e}") from None

    def _admit_grammar_waiters(self) -> bool:
        """Structured-output requests that waited for the grammar library's vocabulary view (built
        in its own thread, off the step) join the scheduler once it is there; True when they did.
        With nothing else to run, waits at most GRAMMAR_POLL_S for it instead of spinning."""
        if not self._grammar_wait or not self.grammars.wait_ready(0.0 if self.scheduler.has_work() else GRAMMAR_POLL_S):
            return False
        for seq in self._grammar_wait:
            try:
                self._attach_grammar(seq)
            except RequestValidationError as e:
                log.warning("%s", e)
                self._finish(seq, "abort")
                continue
            self.scheduler.add(seq)
        self._grammar_wait.clear()
        return True

    def _in_use(self, request_id: str) -> bool:
        return (request_id in self.families or self.scheduler.find(request_id) is not None
                or any(rid == request_id for rid, _ in self._to_emit)
                or any(s.request_id == request_id for s in self._grammar_wait))

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks (every choice's); the next step() reports it finished with "abort"."""
        if self.scheduler.release_parked(request_id):
            return
        waiting = [s for s in self._grammar_wait if s.request_id == request_id]
        if waiting:
            self._grammar_wait.remove(waiting[0])
            self._finish(waiting[0], "abort")
            return
        family = self.families.members(request_id)
        if family is None:
            seq = self.scheduler.find(request_id)
            family = [seq] if seq is not None else []
        for member in family:
            if not member.finished:
                self._finish(member, "abort")

    def kv_ready(self, request_id: str, ok: bool, first_token_ids: list[int] | None = None,
                 num_cached_tokens: int | None = None, first_token_logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None) -> None:
        """GENERATION_ONLY: the KVPull blocks hold the prompt KV (ok) or the pull failed (the
        connector's worker side reports it; see engine.kv_connector).

        ``first_token_ids`` / ``num_cached_tokens`` (the ctx server's first sample and prefix-cache
        hit) and ``first_token_logprobs`` / ``prompt_logprobs`` (the ctx server's logprobs of them
        and of the prompt, when the request asks for logprobs / completions ``echo``) are given
        here for a request submitted with ``first_tokens_later`` (generation_first); None keeps
        what the request was submitted with.
        """
        connector = self.scheduler.connector
        seq = connector.loading.get(request_id) if connector is not None else None
        if seq is None:
            return
        if not ok:
            self._finish(seq, "abort")
            return
        if first_token_ids is not None:
            seq.first_token_ids = list(first_token_ids)
        if num_cached_tokens is not None:
            seq.num_cached_tokens = num_cached_tokens
        if first_token_logprobs is not None:
            seq.first_token_logprobs = list(first_token_logprobs)
        if prompt_logprobs is not None and seq.prompt_logprobs is not None:
            seq.prompt_logprobs = list(prompt_logprobs)
        self.scheduler.kv_arrived(request_id)
        logprobs = seq.first_token_logprobs if seq.sampling.logprobs is not None else []
        picks = [(t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(seq.first_token_ids)]
        if seq.n > 1:  # one first token per choice (the ctx server sampled them): fork now
            self._fork(seq, picks)
            return
        for token, logprob in picks:
            reason = self.output_processor.add_token(seq, token, logprob)
            if reason is not None:
                self._finish(seq, reason)
                return
        if seq.kv_num_tokens is not None:  # moved: the pull brought the first tokens' KV too, all but the last
            seq.num_computed = seq.kv_num_tokens
            self.scheduler.cache_computed(seq)
        self._to_emit[(request_id, seq.index)] = seq

    def move_out(self) -> list[str]:
        """Drain by moving KV: stop every movable request that sits at a decode step boundary (its
        last sampled token not computed yet, nothing pending for its caller) and park its blocks for
        another engine to pull. Each such request finishes with reason ``"moved"`` in the next
        :meth:`step`'s outputs, carrying :class:`engine.request.MovedKV`; its blocks stay allocated
        until :meth:`release_parked` (or :meth:`abort_request`). Requests not in decode yet (waiting,
        pulling, prefilling) are left alone: call again after later steps. Returns the park ids
        moved (``MovedKV.park_id``: the request id for n = 1).

        A movable n > 1 request moves choice by choice (:meth:`_move_choices`) once every choice that
        goes on sits at a decode step boundary: each finishes with ``"moved"``, its blocks parked
        under ``"<request id>-c<i>"``. When a choice cannot be parked it is **handed back** instead
        (:meth:`_hand_back`): every unfinished choice finishes with ``"handed_back"``, blocks freed,
        and the caller continues each choice elsewhere by prefilling again."""
        if self.scheduler.connector is None:
            return []
        moved: list[str] = []
        for seq in list(self.scheduler.running):
            if not seq.movable or seq.finished or not seq.in_decode or (seq.request_id, seq.index) in self._to_emit:
                continue
            family = self.families.members(seq.request_id)
            if family is not None:
                moved += self._move_choices(family)
                continue
            if any(b < 0 for b in seq.block_ids):  # a sliding-window hit's NULL_BLOCK entries: nothing to serve
                continue
            if seq.request_id in self.scheduler.connector.parked:  # its id is a moved choice's park id
                continue
            moved.append(self._park_moved(seq, None))
        self.requests_moved_out += len(moved)
        return moved

    def _park_moved(self, seq: Sequence, choice: int | None) -> str:
        """Finish ``seq`` with ``"moved"``, its blocks parked under its MovedKV's park id (returned)."""
        seq.moved = MovedKV(list(seq.token_ids), seq.num_prompt_tokens, seq.num_computed,
                            seq.block_hashes()[:seq.num_computed // self.config.block_size],
                            seq.request_id, choice)
        self._finish(seq, MOVED)
        return seq.moved.park_id

    def _move_choices(self, family: list[Sequence]) -> list[str]:
        """Move every unfinished choice of a forked request (park ids returned), if all of them sit
        at a decode step boundary with nothing pending for the caller; hand the request back instead
        when one cannot be parked (NULL_BLOCK entries of a sliding-window hit, or its park id taken).
        Each choice's block table holds its own reference to the shared prompt blocks
        (engine.block_manager), so each park and its release count once."""
        going_on = [m for m in family if not m.finished]
        if not going_on or not all(m.in_decode and (m.request_id, m.index) not in self._to_emit for m in going_on):
            return []
        parked = self.scheduler.connector.parked if self.scheduler.connector is not None else {}
        if any(b < 0 for m in going_on for b in m.block_ids) or any(
                f"{m.request_id}-c{m.index}" in parked for m in going_on):
            self._hand_back(going_on)
            return []
        return [self._park_moved(m, m.index) for m in going_on]

    def _hand_back(self, going_on: list[Sequence]) -> None:
        """Finish these unfinished choices of a forked request with ``"handed_back"`` (blocks freed)."""
        for member in going_on:
            self._finish(member, HANDED_BACK)
        self.requests_handed_back += 1

    def release_parked(self, request_id: str) -> bool:
        """Free a CONTEXT_ONLY request's handed-off blocks, or a moved request's / choice's
        (``request_id``: its ``MovedKV.park_id``). False if it holds none."""
        return self.scheduler.release_parked(request_id)

    def has_work(self) -> bool:
        return bool(self._to_emit) or bool(self._grammar_wait) or self.scheduler.has_work()

    def close(self) -> None:
        """Join the threads this engine owns (the grammar library's vocabulary build, if started)."""
        if self.tp.is_driver:
            self.grammars.close()

    def step(self, extra: object = None) -> StepResult:
        """Schedule, run the model once, apply the sampled tokens; return outputs and KV pulls
        (``stalled`` when nothing could be scheduled and nothing changed).

        TP: the plan goes to the followers first, with `extra` (any picklable, not None), which
        their on_extra receives before they run that step; extra is sent even when no model runs.
        Raises RuntimeError when a follower died or stalled past the group's timeout.
        """
        self._require_driver()
        clock = self.step_clock
        clock.start()
        admitted = self._admit_grammar_waiters()
        had_running = bool(self.scheduler.running)  # running sequences always run (or are preempted)
        batch = self.scheduler.schedule()
        pulls = batch.pulls
        has_extra = extra is not None
        clock.lap("schedule")
        if batch.items:
            plan, seqs, spans = self.runner.plan(batch.items)
            plan.copies, self._pending_copies = self._pending_copies, []
            clock.lap("plan")
            inputs_s = self.runner.inputs_s
            with self._tp_unit():
                self._broadcast(TPMessage(RUN, plan, extra, has_extra))
                logits = self.runner.forward(plan)
            clock.lap("forward")
            clock.move("forward", "plan", self.runner.inputs_s - inputs_s)  # its input tensors: plan work
            self.runner.record_prompt_logprobs(spans, logits[len(seqs):])
            sampled = self.runner.sample_with_logprobs(seqs, logits[:len(seqs)])
            clock.lap("sample")
            for seq, k in batch.items:
                self.prefill_tokens += max(0, min(seq.num_computed + k, seq.num_prompt_tokens) - seq.num_computed)
                seq.num_computed += k
                self.tokens_computed += k
                self.scheduler.cache_computed(seq)  # before a finish frees (or parks) its blocks
                picks = sampled.get((seq.request_id, seq.index))
                if picks is not None and len(picks) > 1:
                    self._fork(seq, picks)
                elif picks is not None:
                    self._apply_token(seq, *picks[0])
        elif has_extra:
            self._broadcast(TPMessage(EXTRA, extra=extra, has_extra=True))
        outputs = self._drain_outputs()
        clock.lap("outputs")
        kind = step_kind([k for _, k in batch.items])
        clock.commit(kind)
        # Nothing ran, was admitted or preempted: the scheduler's state is what it was before.
        stalled = not (had_running or batch.items or pulls or outputs or admitted or self._grammar_wait)
        return StepResult(outputs=outputs, kv_pulls=pulls, stalled=stalled, kind=kind)

    # ---- tensor parallel ------------------------------------------------------------------
    def broadcast_extra(self, extra: object) -> None:
        """Rank 0: hand `extra` (any picklable) to every follower's on_extra, outside a step."""
        self._require_driver()
        self._broadcast(TPMessage(EXTRA, extra=extra, has_extra=True))

    def stop_followers(self) -> None:
        """Rank 0: make every follower's run_follower() return and stop the keepalives; after
        it, step() must not run the model again. No-op without TP (or when already stopped)."""
        self._require_driver()
        if self._plans is not None:
            self._plans.stop()
            self._plans = None

    def run_follower(self, on_extra: Callable[[object], None] | None = None) -> None:
        """Ranks > 0: run every plan rank 0 broadcasts until stop_followers().

        on_extra(extra) runs before the step that carries it. Rank 0 sends keepalives while
        idle, so this raises RuntimeError only when rank 0 dies or hangs for the group's timeout.
        """
        if self.tp.is_driver:
            raise RuntimeError("run_follower() is for TP ranks > 0")
        while True:
            try:
                msg = broadcast_message(self.tp, None)
            except Exception:
                log.exception("TP rank %d: no plan from rank 0 (timeout %.0f s or peer gone)",
                              self.tp.rank, self.tp.timeout_s)
                raise
            if msg.kind == STOP:
                return
            if msg.has_extra and on_extra is not None:
                on_extra(msg.extra)
            if msg.kind == RUN:
                self.runner.copy_blocks(msg.plan.copies)  # forks' copy-on-write blocks (rank 0 copied at the fork)
                self.runner.forward(msg.plan, compute_logits=False)

    def _require_driver(self) -> None:
        if not self.tp.is_driver:
            raise RuntimeError(f"TP rank {self.tp.rank} is a follower: call run_follower()")

    def _tp_unit(self):
        """Hold the plan lock across a broadcast and its forward (see PlanBroadcaster)."""
        return self._live_plans().lock if self.tp.enabled else contextlib.nullcontext()

    def _broadcast(self, msg: TPMessage) -> None:
        if self.tp.enabled:
            self._live_plans().send(msg)

    def _live_plans(self) -> PlanBroadcaster:
        if self._plans is None:
            raise RuntimeError("TP followers were stopped (stop_followers)")
        return self._plans

    def _fork(self, seq: Sequence, picks: list) -> None:
        """seq (n > 1) computed its prompt: split it into its choices (engine.choices) and give choice
        i its first token picks[i] = (token, logprob). The fork copies blocks before any choice can
        finish (and free the blocks it copies from)."""
        ctx = seq.phase is Phase.CONTEXT_ONLY
        family = fork(seq, self.block_manager, self._copy_block,
                      lambda: IncrementalDetokenizer(self.tokenizer), with_blocks=not ctx)
        self.families.add(family)
        if ctx:
            self._ctx_choices(family, picks)
            return
        for member in family[1:]:
            self.scheduler.adopt(member)
        for member, (token, logprob) in zip(family, picks):
            self._apply_token(member, token, logprob)

    def _ctx_choices(self, family: list[Sequence], picks: list) -> None:
        """CONTEXT_ONLY: each choice ends with its first token; choice 0's blocks are parked if any
        choice goes on (the gen server forks them again)."""
        reasons = [self.output_processor.add_token(m, t, lp) for m, (t, lp) in zip(family, picks)]
        family[0].keep_blocks = any(r is None for r in reasons)
        for member, reason in zip(family[1:], reasons[1:]):
            member.finish_reason, member.status = reason, SeqStatus.FINISHED  # no blocks, never scheduled
            self._to_emit[(member.request_id, member.index)] = member
        self._finish(family[0], reasons[0])

    def _copy_block(self, src: int, dst: int) -> None:
        """A fork's copy-on-write block: copied here now, and by each TP follower before its next step."""
        self.runner.copy_blocks([(src, dst)])
        if self.tp.enabled:
            self._pending_copies.append((src, dst))

    def _apply_token(self, seq: Sequence, token: int, logprob=None) -> None:
        reason = self.output_processor.add_token(seq, token, logprob)
        self._to_emit[(seq.request_id, seq.index)] = seq
        if reason is not None:
            self._finish(seq, reason)
        elif seq.phase is Phase.CONTEXT_ONLY:
            self._finish(seq, None)  # the context phase ends here: the connector parks its blocks

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self._to_emit[(seq.request_id, seq.index)] = seq

    def _drain_outputs(self) -> list[RequestOutput]:
        outputs = []
        for seq in self._to_emit.values():
            parked = list(seq.block_ids) if seq.parked else None
            out = self.output_processor.take_output(seq, parked)
            out.moved = seq.moved
            outputs.append(out)
        self._to_emit.clear()
        return self.families.settle(outputs)

