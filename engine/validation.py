"""Checks applied to a request before it is queued."""
from __future__ import annotations

from engine.errors import RequestValidationError
from engine.request import MAX_CHOICES, EngineRequest, Phase


def validate_request(req: EngineRequest, max_model_len: int, vocab_size: int) -> None:
    """Raise RequestValidationError when req cannot be served by an engine with these limits.

    max_model_len never exceeds the KV cache, so a request that fits it also fits the cache.
    """
    p = len(req.prompt_token_ids)
    if p == 0:
        raise RequestValidationError(f"request {req.request_id}: empty prompt")
    if p >= max_model_len:
        raise RequestValidationError(
            f"request {req.request_id}: prompt has {p} tokens, max_model_len is {max_model_len}")
    bad = [t for t in req.prompt_token_ids + list(req.first_token_ids or [])
           + list(req.sampling.logit_bias or {})
           if not 0 <= t < vocab_size]
    if bad:
        raise RequestValidationError(f"request {req.request_id}: token ids out of range: {bad[:5]}")
    try:
        phase = Phase(req.phase)
        req.sampling.validate()
    except ValueError as e:
        raise RequestValidationError(f"request {req.request_id}: {e}") from e
    first = req.first_token_ids
    _validate_choices(req, phase, max_model_len)
    if req.kv_num_tokens is not None and (phase is not Phase.GENERATION_ONLY or req.first_tokens_later):
        raise RequestValidationError(f"request {req.request_id}: kv_num_tokens only goes with GENERATION_ONLY "
                                     "and its first tokens")
    if phase is Phase.GENERATION_ONLY and req.first_tokens_later:
        if first:
            raise RequestValidationError(
                f"request {req.request_id}: first_tokens_later excludes first_token_ids (they come with kv_ready)")
        if p + 1 > max_model_len:
            raise RequestValidationError(
                f"request {req.request_id}: prompt + first token exceed max_model_len")
    elif phase is Phase.GENERATION_ONLY:
        if not first:
            raise RequestValidationError(
                f"request {req.request_id}: GENERATION_ONLY needs first_token_ids")
        if p + (len(first) if req.n == 1 else 1) > max_model_len:
            raise RequestValidationError(
                f"request {req.request_id}: prompt + first tokens exceed max_model_len")
        if req.kv_num_tokens is not None and not p <= req.kv_num_tokens <= p + len(first) - 1:
            raise RequestValidationError(
                f"request {req.request_id}: kv_num_tokens {req.kv_num_tokens} outside [prompt {p}, "
                f"prompt + first tokens - 1 = {p + len(first) - 1}]")
    elif first:
        raise RequestValidationError(
            f"request {req.request_id}: first_token_ids only go with GENERATION_ONLY")


def _validate_choices(req: EngineRequest, phase: Phase, max_model_len: int) -> None:
    """n in [1, MAX_CHOICES]; choice_index in [0, MAX_CHOICES) and only with n = 1; n > 1 is not a
    moved request's pull (a movable n > 1 request moves choice by choice on a drain, LLMEngine.move_out: each as n = 1); a GENERATION_ONLY request with n > 1 brings one first token per
    choice (not later: generation_first does not fork)."""
    if not 1 <= req.n <= MAX_CHOICES:
        raise RequestValidationError(f"request {req.request_id}: n must be in [1, {MAX_CHOICES}], got {req.n}")
    if not 0 <= req.choice_index < MAX_CHOICES or (req.choice_index and req.n > 1):
        raise RequestValidationError(f"request {req.request_id}: choice_index {req.choice_index} needs n = 1 and "
                                     f"must be in [0, {MAX_CHOICES})")
    if req.n > 1 and req.kv_num_tokens is not None:
        raise RequestValidationError(f"request {req.request_id}: an n > 1 request cannot be a moved one's pull "
                                     "(a moved choice continues as n = 1 with its choice_index)")
    if req.n == 1 or phase is not Phase.GENERATION_ONLY:
        return
    if req.first_tokens_later:
        raise RequestValidationError(f"request {req.request_id}: n > 1 cannot wait for its first tokens "
                                     "(generation_first); send them with the request")
    if len(req.first_token_ids or []) != req.n:
        raise RequestValidationError(f"request {req.request_id}: n={req.n} needs one first token per choice, "
                                     f"got {len(req.first_token_ids or [])}")
