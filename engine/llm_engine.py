"""LLMEngine: the single-threaded facade (add_request / step / abort / KV hand-off)."""
from __future__ import annotations

import logging
import time

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestValidationError
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.request import EngineRequest, KVPull, Phase, RequestOutput, StepResult
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from engine.validation import validate_request

log = logging.getLogger(__name__)


class LLMEngine:
    """One model, one paged KV cache, one scheduler. Call every method from one thread.

    kv_cache: [num_kv_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim], allocated
    once and never replaced: other threads may copy parked / KVPull blocks while step() runs.
    """

    def __init__(self, config: EngineConfig):
        """Load weights and tokenizer, allocate the KV cache. Raises FileNotFoundError/ValueError."""
        t0 = time.perf_counter()
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = getattr(torch, config.dtype)
        model, path = load_model(config.model, dtype)
        self.model_config = model.config
        self.tokenizer = Tokenizer.from_model_path(path, model.config.eos_token_ids)
        mc = model.config
        self.kv_cache = torch.zeros(config.num_kv_blocks, mc.num_layers, 2, config.block_size,
                                    mc.num_kv_heads, mc.head_dim, dtype=dtype)
        self.max_model_len = self._max_model_len()
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(model, self.kv_cache, config.block_size, Sampler())
        self.output_processor = OutputProcessor(self.tokenizer.eos_token_ids, self.max_model_len)
        self._to_emit: dict[str, Sequence] = {}
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

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. Raises RequestValidationError when it cannot be served."""
        if req.request_id in self._to_emit or self.scheduler.find(req.request_id) is not None:
            raise RequestValidationError(f"request id {req.request_id!r} is already in use")
        validate_request(req, self.max_model_len, self.model_config.vocab_size)
        detok = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(Sequence(req, detok))

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks; the next step() reports it finished with "abort"."""
        if self.scheduler.release_parked(request_id):
            return
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        self._finish(seq, "abort")

    def kv_ready(self, request_id: str, ok: bool) -> None:
        """GENERATION_ONLY: the KVPull blocks hold the prompt KV (ok) or the pull failed."""
        seq = self.scheduler.pulling.get(request_id)
        if seq is None:
            return
        if not ok:
            self._finish(seq, "abort")
            return
        self.scheduler.kv_arrived(request_id)
        for token in seq.first_token_ids:
            reason = self.output_processor.add_token(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                return
        self._to_emit[request_id] = seq

    def release_parked(self, request_id: str) -> bool:
        """Free a CONTEXT_ONLY request's handed-off blocks. False if it holds none."""
        return self.scheduler.release_parked(request_id)

    def has_work(self) -> bool:
        return bool(self._to_emit) or self.scheduler.has_work()

    def step(self) -> StepResult:
        """Schedule, run the model once, apply the sampled tokens; return outputs and KV pulls."""
        batch = self.scheduler.schedule()
        pulls = [KVPull(s.request_id, s.block_ids[:self.block_manager.blocks_needed(s.num_tokens)],
                        s.num_tokens) for s in batch.pulls]
        if batch.items:
            sampled = self.runner.execute(batch.items)
            for seq, k in batch.items:
                seq.num_computed += k
                if seq.request_id in sampled:
                    self._apply_token(seq, sampled[seq.request_id])
        return StepResult(outputs=self._drain_outputs(), kv_pulls=pulls)

    def _apply_token(self, seq: Sequence, token: int) -> None:
        reason = self.output_processor.add_token(seq, token)
        self._to_emit[seq.request_id] = seq
        if reason is not None:
            self._finish(seq, reason)
        elif seq.phase is Phase.CONTEXT_ONLY:
            self._finish(seq, None, park=True)

    def _finish(self, seq: Sequence, reason: str | None, park: bool = False) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq, park=park)
        self._to_emit[seq.request_id] = seq

    def _drain_outputs(self) -> list[RequestOutput]:
        outputs = []
        for seq in self._to_emit.values():
            parked = list(seq.block_ids) if seq.parked else None
            outputs.append(self.output_processor.take_output(seq, parked))
        self._to_emit.clear()
        return outputs
