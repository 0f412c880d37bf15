"""Tokenizer and identity routes of one ctx/gen server (vLLM's and OpenAI's shapes).

* ``POST /tokenize``: ``{prompt}`` or ``{messages}`` → ``{count, max_model_len, tokens, token_strs}``
  (chat messages are rendered with the model's chat template, as ``/v1/chat/completions`` does,
  with the body's ``tools`` and ``chat_template_kwargs``).
* ``POST /detokenize``: ``{tokens}`` → ``{prompt}`` (special tokens kept, as vLLM does).
* ``GET /v1/models/{id}``: the model card, or 404 ``model_not_found``.
* ``GET /version``: ``{"version": ...}`` of the installed pdserve.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from executor.http_server import ApiError, ServerState, read_request
from executor.openai_adapter import BadRequest, chat_prompt_ids
from pdserve.version import pdserve_version
from pdserve.request_body import BodyError, decode_json, read_limited, validate_request
from pdserve.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, TokenizeChatRequest,
                              TokenizeCompletionRequest, TokenizeResponse, VersionResponse, now_s)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.config.model.name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{state.config.model.name}`",
                       param="model", code="model_not_found")


def _validated(raw: dict, model: type) -> object:
    try:
        return validate_request(raw, model)
    except BodyError as err:
        raise ApiError(err.status, err.message, param=err.param) from None


def _token_ids(state: ServerState, raw: dict) -> tuple[list[int], bool]:
    """(token ids, whether to return their strings). Raises ApiError 400/404/422."""
    tok = state.client.tokenizer
    if "messages" in raw:
        body = _validated(raw, TokenizeChatRequest)
        _check_model(state, body.model)
        try:
            return chat_prompt_ids(body, tok), body.return_token_strs
        except BadRequest as err:
            raise ApiError(400, str(err), param=err.param) from None
    body = _validated(raw, TokenizeCompletionRequest)
    _check_model(state, body.model)
    return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens), body.return_token_strs


def tokenize_router(state: ServerState) -> APIRouter:
    """The routes above, over ``state.client.tokenizer``."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        try:
            raw = decode_json(await read_limited(request))
        except BodyError as err:
            raise ApiError(err.status, err.message, param=err.param, close_connection=err.close_connection) from None
        ids, with_strs = _token_ids(state, raw)
        strs = state.client.tokenizer.hf.convert_ids_to_tokens(ids) if with_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=state.client.max_model_len, tokens=ids,
                                             token_strs=strs).model_dump())

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_request(request, DetokenizeRequest)
        _check_model(state, body.model)
        bad = [t for t in body.tokens if t >= state.vocab_size]
        if bad:
            raise ApiError(400, f"token ids out of range [0, {state.vocab_size}): {bad[:5]}", param="tokens")
        text = state.client.tokenizer.decode(list(body.tokens), skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @router.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> JSONResponse:
        _check_model(state, model_id)
        card = ModelCard(id=model_id, created=now_s(), max_model_len=state.client.max_model_len)
        return JSONResponse(card.model_dump())

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(VersionResponse(version=pdserve_version()).model_dump())

    return router
