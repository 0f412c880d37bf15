"""Request and result types exchanged with the engine's caller."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engine.logprobs import TokenLogprob
from engine.sampling_params import SamplingParams


MAX_CHOICES = 16  # EngineRequest.n at most (the HTTP layer refuses more with a 422)


class Phase(str, Enum):
    """Which part of the request this engine serves (disaggregated prefill/decode)."""

    CONTEXT_AND_GENERATION = "context_and_generation"
    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"


@dataclass
class EngineRequest:
    """A request. GENERATION_ONLY needs first_token_ids (the token(s) the ctx server sampled).

    cache_salt: requests with different salts never share prefix-cache blocks (vLLM's field).
    num_cached_tokens: GENERATION_ONLY only: the prompt tokens the ctx server found in its prefix
    cache, reported in this request's outputs.
    source_block_hashes: GENERATION_ONLY only: the ctx server's hashes (16 bytes each,
    pdserve.block_hash) of the prompt's full blocks, in order; leading blocks this engine's prefix
    cache holds under those hashes (token ids compared) are reused instead of pulled. None = pull all.
    first_tokens_later: GENERATION_ONLY of ``schedule_style: generation_first``: the request is
    admitted (blocks allocated) before the ctx server has sampled; first_token_ids and
    num_cached_tokens come with :meth:`engine.llm_engine.LLMEngine.kv_ready`.
    n: choices (OpenAI's ``n``): one prefill, then n decodes forked from it (engine.choices).
    GENERATION_ONLY with n > 1: first_token_ids (and first_token_logprobs) hold one token per
    choice, in choice order (what the ctx server sampled for each), not consecutive tokens. An
    n > 1 request is never a moved one's pull (``kv_num_tokens``); a ``movable`` one is moved choice
    by choice on a move_kv drain (LLMEngine.move_out: each choice parked under its own id, and
    continued elsewhere as an n = 1 pull with its ``choice_index``), or handed back when a choice
    cannot be parked (finish reason ``"handed_back"``, blocks freed).
    choice_index: an n = 1 request that continues choice ``choice_index`` of an n > 1 request (a
    migrated or moved choice): it samples with that choice index (engine.sampler: noise is a function
    of seed, choice and position), so it draws what that choice would have; its outputs carry it as
    ``index``. 0 for every other request; engine.validation refuses it with n > 1.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    phase: Phase = Phase.CONTEXT_AND_GENERATION
    first_token_ids: list[int] | None = None
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    source_block_hashes: list[bytes] | None = None
    first_token_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_tokens_later: bool = False
    n: int = 1
    movable: bool = False
    kv_num_tokens: int | None = None
    choice_index: int = 0


@dataclass
class MovedKV:
    """What a request moved off a draining engine leaves for its next server (finish reason ``"moved"``).

    token_ids: prompt + every output token so far; the KV of the first ``kv_num_tokens`` of them
    (``len(token_ids) - 1``: the last sampled token has no KV yet) sits in the parked blocks
    (``RequestOutput.parked_block_ids``, token order, the last one partial). block_hashes: the
    :mod:`pdserve.block_hash` names of the full blocks among them (partial pulls; [] without a
    prefix cache). choice_index: None for an n = 1 request; for choice i of an n > 1 request, i
    (each moved choice has its own parked blocks and lease, :attr:`park_id`).
    """

    token_ids: list[int]
    num_prompt_tokens: int
    kv_num_tokens: int
    block_hashes: list[bytes]
    request_id: str = ""
    choice_index: int | None = None

    @property
    def park_id(self) -> str:
        """The key of the parked blocks (``LLMEngine.release_parked``) and of their lease: the
        request id for n = 1, ``"<request id>-c<i>"`` for choice i (so choices do not collide)."""
        if self.choice_index is None:
            return self.request_id
        return f"{self.request_id}-c{self.choice_index}"


@dataclass
class RequestOutput:
    """What one step produced for one request.

    new_text is the detokenized delta (stop strings excluded). num_output_tokens counts all output
    tokens so far, first_token_ids included. parked_block_ids lists the blocks a CONTEXT_ONLY
    request left allocated for hand-off (until release_parked/abort_request). queue_time_s (seconds
    from arrival in the engine to first admission, like vLLM's request_queue_time) is set on the
    first output after admission and None on every other. num_cached_tokens: prompt tokens whose
    KV came from the prefix cache at the request's first admission (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``; 0 until admitted). new_logprobs: one per
    new_token_ids entry when sampling.logprobs is set, else None. prompt_logprobs (sampling.
    prompt_logprobs set): one per prompt token (None for the first), on the first output that
    carries output tokens, else None. moved: set on the final output of a request moved off this
    engine (finish reason ``"moved"``, blocks parked under ``moved.park_id``), and on each moved
    choice's last output of an n > 1 request (one park per choice; ``parked_block_ids`` that choice's).

    n > 1 (EngineRequest.n): each output belongs to one choice, ``index``; ``finish_reason`` and
    ``num_output_tokens`` are that choice's, and ``finished`` marks the request's last output
    (every choice finished): a choice that finishes earlier reports its ``finish_reason`` with
    ``finished`` False. With n == 1, index is 0 and finished is the one choice's.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    parked_block_ids: list[int] | None = None
    queue_time_s: float | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0
    moved: MovedKV | None = None


@dataclass
class KVPull:
    """A GENERATION_ONLY request was admitted: fill ``block_ids`` with the KV of the prompt's blocks
    ``first_block ..`` (the sender's lease blocks from that index on; tokens ``first_block *
    block_size .. num_tokens - 1``). The blocks before ``first_block`` came from this engine's prefix
    cache (a partial pull); ``block_ids`` is empty when every prompt block did (nothing to copy: the
    worker side only releases the sender's lease)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    first_block: int = 0


@dataclass
class StepResult:
    """What one step produced. ``stalled``: nothing ran and nothing changed (requests wait for
    blocks or KV pulls while nothing runs), so until a request is added, aborted, released or its
    KV arrives, the next step would do the same; the loop may wait instead of stepping again.
    ``kind``: what the model ran (engine.step_timing.STEP_KINDS: decode, prefill or empty)."""
    outputs: list[RequestOutput]
    kv_pulls: list[KVPull]
    stalled: bool = False
    kind: str = "empty"
