"""Per-request state inside the engine."""
from __future__ import annotations

import copy
import dataclasses
import time
from enum import Enum, auto

from engine.detokenizer import IncrementalDetokenizer
from engine.logprobs import TokenLogprob
from engine.request import EngineRequest, Phase
from engine.structured_output import GrammarMatcher
from pdserve.block_hash import HashChain


class SeqStatus(Enum):
    WAITING = auto()   # queued; no blocks (or freed by preemption)
    PULLING = auto()   # GENERATION_ONLY: blocks allocated, waiting for kv_ready
    RUNNING = auto()   # scheduled every step
    FINISHED = auto()  # done (blocks freed, or parked for a CONTEXT_ONLY hand-off)


class Sequence:
    """Tokens, KV block table and output bookkeeping of one request.

    token_ids = prompt + outputs. num_computed tokens have their KV in the cache; a step that brings
    num_computed to len(token_ids) samples the next token. After preemption num_computed is 0 and
    the whole token list is recomputed, so outputs already emitted are never produced again.

    Prefix cache: hash_chain names the full blocks of token_ids (pdserve.block_hash);
    num_offered_blocks leading blocks of block_ids are cached or were offered to the cache (hit
    blocks count); num_cached_tokens is the hit of the first admission (None before it).
    source_block_hashes (GENERATION_ONLY): the ctx server's names of the prompt's full blocks, which
    the KV connector matches against this engine's cache so that only missing blocks are pulled.

    grammar: the structured-output matcher (engine.structured_output) when sampling.structured_output
    is set: it has consumed every output token, so after a preemption it needs nothing replayed.

    Logprobs: pending_logprobs runs beside pending_token_ids (sampling.logprobs set);
    prompt_logprobs grows as prefill chunks run (entry i: prompt token i, None for i = 0), so a
    recompute after preemption never adds entries twice.

    Choices (n > 1, engine.choices): ``index`` is this sequence's choice; ``n`` > 1 on a request's
    sequence until its fork (then 1: the sequence goes on as choice 0, :meth:`child` makes the
    others). ``keep_blocks``: a CONTEXT_ONLY sequence whose blocks are parked although choice 0
    finished at its first token, because another choice goes on.
    """

    def __init__(self, req: EngineRequest, detokenizer: IncrementalDetokenizer,
                 hash_chain: HashChain | None = None):
        self.request_id = req.request_id
        self.sampling = req.sampling
        self.phase = req.phase
        self.first_token_ids = list(req.first_token_ids or [])
        self.token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.status = SeqStatus.WAITING
        self.detokenizer = detokenizer
        self.output_text = ""          # detokenized output, cut at a stop string
        self.emitted_text_len = 0
        self.pending_token_ids: list[int] = []   # produced but not yet returned to the caller
        self.pending_logprobs: list[TokenLogprob] = []
        self.first_token_logprobs = list(req.first_token_logprobs or [])
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if req.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = list(req.prompt_logprobs) if req.prompt_logprobs else [None]
        self.prompt_logprobs_reported = False
        self.finish_reason: str | None = None
        self.parked = False
        self.moved = None  # engine.request.MovedKV once moved off a draining engine
        self.arrival_s = time.monotonic()
        self.queue_time_s: float | None = None   # arrival → first admitted (blocks allocated)
        self.queue_time_reported = False
        self.hash_chain = hash_chain
        self.num_offered_blocks = 0
        self.num_cached_tokens: int | None = (req.num_cached_tokens
                                              if req.phase is Phase.GENERATION_ONLY else None)
        self.source_block_hashes = req.source_block_hashes  # GENERATION_ONLY: the sender's block names
        self.movable = req.movable
        self.kv_num_tokens = req.kv_num_tokens  # GENERATION_ONLY of a moved request: tokens the pull brings
        self.grammar: GrammarMatcher | None = None  # set by the engine for a structured-output request
        self.index = req.choice_index  # n = 1 continuing choice i of an n > 1 request: draws as choice i
        self.n = req.n
        self.keep_blocks = False

    def child(self, index: int, detokenizer: IncrementalDetokenizer) -> "Sequence":
        """Choice ``index`` forked from this sequence before its first output token: the same
        prompt, computed tokens, prompt logprobs and timings; no blocks (the fork gives them), its
        own detokenizer, hash chain and structured-output matcher (a copy of this one's state: no
        token consumed yet). The queue time is reported by choice 0 only."""
        if self.num_output_tokens:
            raise ValueError(f"request {self.request_id}: a fork needs a sequence without output tokens")
        c = copy.copy(self)
        c.index, c.n = index, 1
        c.token_ids, c.block_ids = list(self.token_ids), []
        c.detokenizer = detokenizer
        c.pending_token_ids, c.pending_logprobs = [], []
        c.first_token_ids, c.first_token_logprobs = [], []
        if self.prompt_logprobs is not None:
            c.prompt_logprobs = list(self.prompt_logprobs)
        if self.hash_chain is not None:
            c.hash_chain = dataclasses.replace(self.hash_chain, hashes=list(self.hash_chain.hashes))
        if self.grammar is not None:
            c.grammar = self.grammar.fork()
        c.queue_time_reported = True
        return c

    def mark_admitted(self) -> None:
        """Record the queue time at the first admission (a preempted sequence keeps its first one)."""
        if self.queue_time_s is None:
            self.queue_time_s = time.monotonic() - self.arrival_s

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def kv_source_tokens(self) -> list[int]:
        """GENERATION_ONLY before its KV landed: the tokens whose KV the sender holds (the prompt, or
        for a moved request prompt + first_token_ids but the last: ``kv_num_tokens`` of them)."""
        if self.kv_num_tokens is None:
            return list(self.token_ids)
        return self.token_ids + self.first_token_ids[:self.kv_num_tokens - self.num_tokens]

    @property
    def in_decode(self) -> bool:
        """Has output and exactly its last sampled token left to compute: a step boundary of decode."""
        return self.num_output_tokens > 0 and self.num_computed == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def block_hashes(self) -> list[bytes]:
        """Hashes of the full blocks of token_ids ([] without a hash chain)."""
        return self.hash_chain.extend(self.token_ids) if self.hash_chain is not None else []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
