"""The orchestrator's tokenizer and identity routes.

* ``POST /tokenize``, ``POST /detokenize``: relayed to one ready server (gen pool first, then ctx;
  every server holds the same tokenizer), with that pool's API key; its answer (status and body)
  is the client's. The servers validate the body (vLLM's shapes, :mod:`executor.tokenize_routes`).
* ``GET /v1/models/{id}``: the cluster's model card (``max_model_len``: the smallest context
  window of its ready servers), or 404 ``model_not_found``.
* ``GET /version``: the installed pdserve's version.
"""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.protocol import ModelCard, VersionResponse, now_s
from pdserve.request_body import BodyError, read_limited
from pdserve import request_id
from pdserve.version import pdserve_version

from .errors import error_response
from .pools import ROLES

RELAY_TIMEOUT_S = 30.0  # tokenizing a context-window prompt takes milliseconds; a server between steps answers


async def _relay(orch, request: Request, path: str) -> Response:
    try:
        raw = await read_limited(request)
    except BodyError as err:
        return error_response(err.status, err.message, param=err.param)
    servers = [(role, s) for role in reversed(ROLES) for s in orch.pools.pool(role).ready()]
    if not servers:
        return error_response(503, f"no ready server to tokenize with ({orch.pools.not_ready_reason()})")
    role, server = servers[0]
    headers = {"content-type": "application/json", **dict(orch.upstream_auth.get(role, ()))}
    if (rid := request_id.current.get()) is not None:
        headers["X-Request-Id"] = rid
    try:
        resp = await orch.client.post(server.url + path, content=raw, headers=headers, timeout=RELAY_TIMEOUT_S)
    except httpx.HTTPError as err:
        return error_response(502, f"{path} on {server.url} failed: {type(err).__name__}: {err}")
    return Response(resp.content, status_code=resp.status_code, media_type="application/json")


def add_tokenize_routes(app: FastAPI, orch) -> None:
    """Install the routes above (``orch``: :class:`orchestrator.app.Orchestrator`)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _relay(orch, request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _relay(orch, request, "/detokenize")

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> JSONResponse:
        name = orch.topology.model.name
        if model_id != name:
            return error_response(404, f"The model '{model_id}' does not exist; this cluster serves '{name}'",
                                  code="model_not_found", param="model")
        card = ModelCard(id=name, created=now_s(), max_model_len=orch.pools.max_model_len())
        return JSONResponse(card.model_dump())

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(VersionResponse(version=pdserve_version()).model_dump())
