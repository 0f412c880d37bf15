"""Apply sampled tokens to sequences: detokenize, check stops, build RequestOutputs."""
from __future__ import annotations

import logging

from engine.logprobs import TokenLogprob
from engine.request import RequestOutput
from engine.sequence import Sequence
from engine.stop_checker import find_stop_string, held_back_len, token_finish_reason

log = logging.getLogger(__name__)


class OutputProcessor:
    """Knows the stop rules (EOS ids, max_model_len) shared by all requests."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def add_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None = None) -> str | None:
        """Append token_id (and its logprob) to seq and its text; return a finish reason or None.
        Stop strings end the output only once it has sampling.min_tokens tokens (vLLM's rule).
        A structured-output grammar consumes the token: EOS at its end is "stop" (ignore_eos too:
        the grammar is complete); a token it refuses ends the request with "abort" (logged)."""
        seq.append_token(token_id, logprob)
        reason = token_finish_reason(seq, token_id, self.eos_token_ids, self.max_model_len)
        if seq.grammar is not None:
            reason = self._grammar_reason(seq, token_id, reason)
        delta = seq.detokenizer.push([token_id])
        if reason is not None:
            delta += seq.detokenizer.flush()
        start = len(seq.output_text)
        seq.output_text += delta
        if seq.sampling.stop and delta and seq.num_output_tokens >= seq.sampling.min_tokens:
            idx = find_stop_string(seq.output_text, seq.sampling.stop, start)
            if idx is not None:
                seq.output_text = seq.output_text[:idx]
                reason = "stop"
        return reason

    def _grammar_reason(self, seq: Sequence, token_id: int, reason: str | None) -> str | None:
        if not seq.grammar.accept(token_id):
            log.warning("request %s: token %d breaks its structured output: %s", seq.request_id, token_id,
                        seq.grammar.error)
            return "abort"
        if token_id in self.eos_token_ids:
            return "stop"  # the mask allows EOS only where the grammar accepts: it is complete
        return reason

    def take_output(self, seq: Sequence, parked_block_ids: list[int] | None = None
                    ) -> RequestOutput:
        """Drain what seq produced since the last call into a RequestOutput.

        While running, a text tail that could begin a stop string is held back.
        """
        end = len(seq.output_text)
        if not seq.finished and seq.sampling.stop:
            end = max(seq.emitted_text_len, end - held_back_len(seq.output_text,
                                                                seq.sampling.stop))
        text = seq.output_text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        tokens, seq.pending_token_ids = seq.pending_token_ids, []
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and tokens and not seq.prompt_logprobs_reported:
            prompt_logprobs, seq.prompt_logprobs_reported = seq.prompt_logprobs, True
        queue_time_s = None
        if seq.queue_time_s is not None and not seq.queue_time_reported:
            queue_time_s, seq.queue_time_reported = seq.queue_time_s, True
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=tokens, new_text=text,
            finished=seq.finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            parked_block_ids=parked_block_ids, queue_time_s=queue_time_s,
            num_cached_tokens=seq.num_cached_tokens or 0,
            new_logprobs=logprobs if seq.sampling.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs, index=seq.index)
