"""Checks applied to a request before it is queued."""
from __future__ import annotations

from engine.errors import RequestValidationError
from engine.request import EngineRequest, Phase


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
        if p + len(first) > max_model_len:
            raise RequestValidationError(
                f"request {req.request_id}: prompt + first tokens exceed max_model_len")
        if req.kv_num_tokens is not None and not p <= req.kv_num_tokens <= p + len(first) - 1:
            raise RequestValidationError(
                f"request {req.request_id}: kv_num_tokens {req.kv_num_tokens} outside [prompt {p}, "
                f"prompt + first tokens - 1 = {p + len(first) - 1}]")
    elif first:
        raise RequestValidationError(
            f"request {req.request_id}: first_token_ids only go with GENERATION_ONLY")
