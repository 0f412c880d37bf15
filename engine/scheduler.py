"""Continuous-batching scheduler: FCFS, token budget, chunked prefill, preemption by recompute,
prefix caching (a new or preempted request starts after its longest cached prefix)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Phase
from engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    """What one step runs: (sequence, number of new tokens) pairs, and admitted KV pulls."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    pulls: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Owns every sequence that holds or waits for KV blocks.

    waiting: FCFS queue (preempted sequences go back to its front). running: scheduled each step,
    in admission order. pulling: GENERATION_ONLY with blocks, waiting for kv_ready. parked:
    CONTEXT_ONLY hand-offs whose blocks stay allocated until released.

    sliding_window: the model's window in tokens when every layer slides by it (None otherwise):
    a prefix hit then needs only the blocks that window reaches (BlockManager.match_prefix).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 sliding_window: int | None = None):
        self.config = config
        self.bm = block_manager
        self.sliding_window = sliding_window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pulling: dict[str, Sequence] = {}
        self.parked: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0   # tokens looked up in the prefix cache (vLLM's name)
        self.prefix_cache_hits = 0      # tokens found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def counts(self) -> dict[str, int]:
        """Sequences per state: ``waiting_requests`` (queued), ``scheduled_requests`` (running),
        ``pulling_requests`` (GENERATION_ONLY waiting for KV), ``parked_requests`` (hand-offs)."""
        return {"waiting_requests": len(self.waiting), "scheduled_requests": len(self.running),
                "pulling_requests": len(self.pulling), "parked_requests": len(self.parked)}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: running sequences first, then admit waiting ones."""
        batch = ScheduledBatch()
        budget = self.config.max_num_tokens
        preempted = self._schedule_running(batch, budget)
        budget -= sum(k for _, k in batch.items)
        if not preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        """Give running sequences tokens; preempt the newest when blocks run out."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            k = min(seq.num_tokens - seq.num_computed, budget)
            while not self.bm.can_grow(seq.block_ids, seq.num_computed + k):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self.bm.grow(seq.block_ids, seq.num_computed + k)
            batch.items.append((seq, k))
            budget -= k
            i += 1
        return preempted

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        max_seqs = self.config.max_batch_size
        while self.waiting and len(self.running) + len(self.pulling) < max_seqs:
            seq = self.waiting[0]
            if seq.needs_kv_pull:
                if not self._admit_pull(seq):
                    return
                batch.pulls.append(seq)
                continue
            if budget <= 0:
                return
            hit = self._cached_prefix(seq)
            start = len(hit) * self.bm.block_size
            k = min(seq.num_tokens - start, budget)
            if not self.bm.can_allocate(self.bm.blocks_needed(start + k) - len(hit), sharing=hit):
                return
            self._reuse_prefix(seq, hit)
            self.bm.grow(seq.block_ids, seq.num_computed + k)
            self.waiting.popleft()
            seq.mark_admitted()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, k))
            budget -= k

    # ---- prefix cache ---------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks seq may start after: its longest cached prefix of full blocks, capped at
        num_tokens - 1 tokens so the last token is computed (its logits sample the next token)
        and every block seq writes is its own (a prompt ending on a block boundary recomputes its
        last block into a fresh one). Under a sliding window the hit may start with NULL_BLOCK
        entries, except for a CONTEXT_ONLY request: its whole block table is handed off. None for a
        request that wants prompt logprobs (vLLM's rule)."""
        if not self.bm.enable_caching or seq.hash_chain is None or seq.wants_prompt_logprobs:
            return []  # prompt logprobs need every prompt position's logits: computed, not cached
        max_blocks = (seq.num_tokens - 1) // self.bm.block_size
        window = None if seq.phase is Phase.CONTEXT_ONLY else self.sliding_window
        return self.bm.match_prefix(seq.block_hashes()[:max_blocks], seq.token_ids, window)

    def _reuse_prefix(self, seq: Sequence, hit: list[int]) -> None:
        """Start seq (no blocks yet) after the cached blocks ``hit``; count the lookup."""
        seq.block_ids = self.bm.share(hit)
        seq.num_computed = len(hit) * self.bm.block_size
        seq.num_offered_blocks = len(hit)
        if self.bm.enable_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed

    def cache_computed(self, seq: Sequence) -> None:
        """Offer seq's full blocks computed since the last call (prefill or decode) to the cache."""
        bs = self.bm.block_size
        full = min(seq.num_computed // bs, len(seq.block_ids))
        if full <= seq.num_offered_blocks or seq.hash_chain is None or not self.bm.enable_caching:
            return
        hashes = seq.block_hashes()
        for i in range(seq.num_offered_blocks, full):
            self.bm.cache_block(seq.block_ids[i], hashes[i], seq.token_ids[i * bs:(i + 1) * bs],
                                hashes[i - 1] if i else None)
        seq.num_offered_blocks = full

    def prefix_cache_stats(self) -> dict[str, int]:
        """``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens looked up / found, every
        admission: a preempted request's recompute counts again, as in vLLM) and ``cached_blocks``."""
        return {"prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits, "cached_blocks": self.bm.num_cached_blocks}

    def _admit_pull(self, seq: Sequence) -> bool:
        # Room for the prompt and the first token(s), whose KV is computed here after the pull
        # (generation_first: one, before the ctx server has said which).
        need = self.bm.blocks_needed(seq.num_tokens + max(len(seq.first_token_ids), 1))
        if not self.bm.can_allocate(need):
            return False
        seq.block_ids = self.bm.allocate(need)
        self.waiting.popleft()
        seq.mark_admitted()
        seq.status = SeqStatus.PULLING
        self.pulling[seq.request_id] = seq
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and requeue it first; its tokens so far become the new prompt."""
        self.running.remove(seq)
        self.bm.deallocate(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_offered_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def kv_arrived(self, request_id: str) -> Sequence | None:
        """Move a pulling sequence to running; its prompt KV is now in its blocks, whose full ones
        join the prefix cache (only now: a failed pull never caches anything)."""
        seq = self.pulling.pop(request_id, None)
        if seq is not None:
            seq.num_computed = seq.num_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.cache_computed(seq)
        return seq

    def finish(self, seq: Sequence, park: bool = False) -> None:
        """Take seq out of scheduling; free its blocks, or park them for a hand-off."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pulling.pop(seq.request_id, None)
        seq.status = SeqStatus.FINISHED
        if park:
            seq.parked = True
            self.parked[seq.request_id] = seq.block_ids
        else:
            self.bm.deallocate(seq.block_ids)
            seq.block_ids = []

    def find(self, request_id: str) -> Sequence | None:
        """A live (not finished) sequence by id."""
        if request_id in self.pulling:
            return self.pulling[request_id]
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def release_parked(self, request_id: str) -> bool:
        blocks = self.parked.pop(request_id, None)
        if blocks is None:
            return False
        self.bm.deallocate(blocks)
        return True
