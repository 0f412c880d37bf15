"""Continuous-batching scheduler: FCFS, token budget, chunked prefill, preemption by recompute,
prefix caching (a new or preempted request starts after its longest cached prefix). KV that moves
in or out of the engine (disaggregation) is the KV connector's business (engine.kv_connector)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.kv_connector import NO_CONNECTOR_COUNTS, KVConnector
from engine.request import KVPull, Phase
from engine.sequence import SeqStatus, Sequence
from pdserve.config import EngineSettings


@dataclass
class ScheduledBatch:
    """What one step runs: (sequence, number of new tokens) pairs, and the KV loads the connector
    admitted (blocks the worker side fills)."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    pulls: list[KVPull] = field(default_factory=list)


class Scheduler:
    """Owns every sequence that holds or waits for KV blocks.

    waiting: FCFS queue (preempted sequences go back to its front). running: scheduled each step,
    in admission order. The connector (None: colocated only) holds the sequences loading their KV
    from elsewhere and the blocks parked for a hand-off (engine.kv_connector).

    sliding_window: the model's window in tokens when every layer slides by it (None otherwise):
    a prefix hit then needs only the blocks that window reaches (BlockManager.match_prefix).
    """

    def __init__(self, config: EngineSettings, block_manager: BlockManager, connector: KVConnector | None = None,
                 sliding_window: int | None = None):
        self.config = config
        self.bm = block_manager
        self.connector = connector
        self.sliding_window = sliding_window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache_queries = 0   # tokens looked up in the prefix cache (vLLM's name)
        self.prefix_cache_hits = 0      # tokens found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def counts(self) -> dict[str, int]:
        """Sequences per state: ``waiting_requests`` (queued), ``scheduled_requests`` (running), and
        the connector's :meth:`KVConnector.counts` (``pulling_requests``, ``parked_requests``, …)."""
        extra = self.connector.counts() if self.connector is not None else NO_CONNECTOR_COUNTS
        return {"waiting_requests": len(self.waiting), "scheduled_requests": len(self.running), **extra}

    @property
    def num_loading(self) -> int:
        return len(self.connector.loading) if self.connector is not None else 0

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
        while self.waiting and len(self.running) + self.num_loading < max_seqs:
            seq = self.waiting[0]
            if self.connector is not None and self.connector.needs_load(seq):
                pull = self.connector.admit_load(seq)
                if pull is None:
                    return
                self.waiting.popleft()
                batch.pulls.append(pull)
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

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and requeue it first; its tokens so far become the new prompt."""
        self.running.remove(seq)
        self.bm.deallocate(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_offered_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def adopt(self, seq: Sequence) -> None:
        """Schedule a choice forked from a running sequence (engine.choices): running when it holds
        its prompt's KV (``num_computed`` > 0), else first in the queue, as if preempted."""
        if seq.num_computed:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def kv_arrived(self, request_id: str) -> Sequence | None:
        """Move a loading sequence to running; its prompt KV is now in its blocks, whose full ones
        join the prefix cache (only now: a failed pull never caches anything)."""
        seq = self.connector.finish_load(request_id) if self.connector is not None else None
        if seq is not None:
            seq.num_computed = seq.num_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.cache_computed(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Take seq out of scheduling; free its blocks unless the connector keeps them (a hand-off)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        if self.connector is None or not self.connector.request_finished(seq):
            self.bm.deallocate(seq.block_ids)
            seq.block_ids = []

    def find(self, request_id: str) -> Sequence | None:
        """A live (not finished) sequence by id."""
        if self.connector is not None and request_id in self.connector.loading:
            return self.connector.loading[request_id]
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def release_parked(self, request_id: str) -> bool:
        """Free a hand-off's parked blocks (connector). False if it holds none."""
        return self.connector is not None and self.connector.release(request_id)
