"""KV connector, scheduler side: what KV moves in and out of this engine, and when a request may run.

The seam follows vLLM's KV connector split (learned from its interface, not copied): a **scheduler
side** that decides *what* moves — which blocks a request loads from elsewhere, which blocks a
finished request leaves behind for someone else, when a loading request may run — and a **worker
side** that moves the bytes. Here the scheduler side is :class:`KVConnector` (owned by the
:class:`engine.scheduler.Scheduler`, called on the engine thread); the worker side is the server
role next to the engine loop (:class:`executor.kv_role.WorkerRole`: ``ctx_worker.kv_role`` serves
parked blocks, ``gen_worker.kv_role`` pulls them). The two halves meet at the engine's API:
``StepResult.kv_pulls`` (scheduler side → worker side: "fill these blocks"), ``LLMEngine.kv_ready``
(worker → scheduler: "they are filled", or failed), ``RequestOutput.parked_block_ids`` and
``LLMEngine.release_parked`` (a hand-off's blocks, and their release).

vLLM's verbs and ours: ``get_num_new_matched_tokens`` + ``update_state_after_alloc`` →
:meth:`KVConnector.admit_load` (match the local prefix cache against the sender's block hashes,
allocate the rest, emit a :class:`KVPull` for the missing blocks only); ``get_finished`` →
:meth:`KVConnector.finish_load`; ``request_finished`` (delay the free) →
:meth:`KVConnector.request_finished` (park).

An engine built with ``LLMEngine(..., kv_connector="none")`` has no connector: it runs colocated
requests only and refuses ``context_only`` / ``generation_only`` ones.

The wait logic of a ``generation_only`` request lives here: it sits in :attr:`loading` (blocks held,
never scheduled) until :meth:`finish_load`. A ``generation_first`` request (``first_tokens_later``:
it arrives before the ctx server has sampled) is admitted the same way, with room for one first
token and no sender hashes yet (a full pull); the worker side holds its :class:`KVPull` until the
ctx params arrive (``gen_worker.kv_source.KVSources``), and ``kv_ready`` brings the first tokens.
"""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import KVPull, Phase
from engine.sequence import SeqStatus, Sequence

MOVED = "moved"  # finish reason of a request moved off a draining engine (its blocks parked)
HANDED_BACK = "handed_back"  # finish reason of an n > 1 request handed back by a draining engine (blocks freed)


class KVConnector:
    """Scheduler side of disaggregated prefill/decode (ctx: parks; gen: loads).

    loading: ``generation_only`` sequences holding blocks, waiting for their KV (not scheduled).
    parked: block tables of finished ``context_only`` hand-offs, kept until :meth:`release`.
    Counters (blocks): ``blocks_loaded`` requested from the sender, ``blocks_reused`` found in the
    local prefix cache instead (partial pulls).
    """

    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.loading: dict[str, Sequence] = {}
        self.parked: dict[str, list[int]] = {}
        self.blocks_loaded = 0
        self.blocks_reused = 0

    # ---- loading (gen) --------------------------------------------------------------------
    @staticmethod
    def needs_load(seq: Sequence) -> bool:
        """Whether seq may run only after its prompt KV came from elsewhere (GENERATION_ONLY, first
        admission: after a preemption its tokens are recomputed locally like any request's)."""
        return seq.phase is Phase.GENERATION_ONLY and seq.num_output_tokens == 0

    def admit_load(self, seq: Sequence) -> KVPull | None:
        """Give seq blocks for its prompt and first token(s) and name the ones to fill; None when the
        blocks do not fit now (seq stays waiting).

        The prompt's leading full blocks that this engine's prefix cache already holds under the
        sender's hashes (``seq.source_block_hashes``, token ids compared) are shared instead of
        pulled, so the pull names only the missing tail: ``KVPull.first_block`` is the index (in the
        prompt's blocks) of its first block. Every full prompt block may be reused: the next KV
        this engine writes is the first output token's, at position ``num_tokens``, past them.

        A moved request (``seq.kv_num_tokens``: the sender's KV covers prompt + first tokens but the
        last) is matched and pulled over those ``kv_num_tokens`` tokens, partial last block included.
        """
        kv_tokens = seq.kv_source_tokens()
        hit = self._reusable_prefix(seq, kv_tokens)
        # generation_first (first_tokens_later): room for one first token, not yet sampled by the ctx server
        # n > 1: first_token_ids holds one token per choice; each choice forks after the pull
        first = 1 if seq.n > 1 else max(len(seq.first_token_ids), 1)
        need = self.bm.blocks_needed(seq.num_tokens + first) - len(hit)
        if not self.bm.can_allocate(need, sharing=hit):
            return None
        seq.block_ids = self.bm.share(hit) + self.bm.allocate(need)
        seq.num_offered_blocks = len(hit)
        seq.mark_admitted()
        seq.status = SeqStatus.PULLING
        self.loading[seq.request_id] = seq
        kv_blocks = self.bm.blocks_needed(len(kv_tokens))
        self.blocks_reused += len(hit)
        self.blocks_loaded += kv_blocks - len(hit)
        return KVPull(seq.request_id, seq.block_ids[len(hit):kv_blocks], len(kv_tokens), first_block=len(hit))

    def _reusable_prefix(self, seq: Sequence, kv_tokens: list[int]) -> list[int]:
        hashes = seq.source_block_hashes
        if not hashes or not self.bm.enable_caching:
            return []
        full = len(kv_tokens) // self.bm.block_size
        return self.bm.match_prefix(hashes[:full], kv_tokens)

    def finish_load(self, request_id: str) -> Sequence | None:
        """Take a loading sequence out of :attr:`loading` (its KV landed, or the load failed)."""
        return self.loading.pop(request_id, None)

    # ---- parking (ctx) --------------------------------------------------------------------
    def request_finished(self, seq: Sequence) -> bool:
        """seq finished: True when its blocks must outlive it (a CONTEXT_ONLY hand-off: one that goes
        on, or whose other choices do, ``seq.keep_blocks``; or a request moved off a draining engine:
        finish reason ``"moved"``, parked under ``seq.moved.park_id``: each moved choice of an n > 1
        request under its own key, its block table holding its own references to the shared prompt
        blocks; parked until :meth:`release`); False: the scheduler frees them now."""
        self.loading.pop(seq.request_id, None)
        hand_off = seq.phase is Phase.CONTEXT_ONLY and (seq.finish_reason is None or seq.keep_blocks)
        if not hand_off and seq.finish_reason != MOVED:
            return False
        seq.parked = True
        self.parked[seq.moved.park_id if seq.moved is not None else seq.request_id] = seq.block_ids
        return True

    def release(self, request_id: str) -> bool:
        """Free a parked hand-off's blocks (``request_id``: the park key, a moved choice's
        ``MovedKV.park_id``). False if it holds none."""
        blocks = self.parked.pop(request_id, None)
        if blocks is None:
            return False
        self.bm.deallocate(blocks)
        return True

    # ---- bookkeeping ----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """``pulling_requests`` (loading), ``parked_requests``, ``kv_blocks_loaded`` / ``kv_blocks_reused``."""
        return {"pulling_requests": len(self.loading), "parked_requests": len(self.parked),
                "kv_blocks_loaded": self.blocks_loaded, "kv_blocks_reused": self.blocks_reused}


NO_CONNECTOR_COUNTS = {"pulling_requests": 0, "parked_requests": 0, "kv_blocks_loaded": 0, "kv_blocks_reused": 0}


def make_connector(kind: str, block_manager: BlockManager) -> KVConnector | None:
    """The scheduler side named by ``LLMEngine``'s ``kv_connector``: ``"disagg"`` or ``"none"`` (None).
    Raises ValueError for another name."""
    if kind == "none":
        return None
    if kind == "disagg":
        return KVConnector(block_manager)
    raise ValueError(f"unknown KV connector {kind!r} (disagg | none)")
