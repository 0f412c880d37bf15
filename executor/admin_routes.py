"""Control-plane routes of one ctx/gen server, added beside the OpenAI routes.

* ``GET /tokenizer``: the HF ``tokenizer.json`` text, chat template and special tokens, so the
  orchestrator can count and hash prompt tokens without torch (routing only).
* ``POST /admin/drain`` (admin token): stop admitting requests; in-flight ones finish; ``/health``
  turns 503 so the orchestrator routes nothing new here. Body ``{"mode": "move_kv"}`` (optional;
  default ``"wait"``): every movable request (the orchestrator marks its streams so) is instead
  moved off at its next decode step: its KV parked under a lease, its stream ended with a
  ``moved`` event that the orchestrator continues on another gen server.
* ``POST /reset_prefix_cache`` (admin token): forget every prefix-cache block hash; answers
  ``{"freed_blocks": N}``, the unreferenced cached blocks freed (blocks in use stay with their
  requests and are never a hit again).

Installed on every frontend of a server (:func:`executor.server_setup.make_state`): a drain sent to
any frontend reaches rank 0, whose state push turns every other frontend to draining too.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from executor.engine_client import EngineDeadError
from executor.http_server import ServerState
from pdserve.auth import admin_token, check_bearer
from pdserve.protocol import error_body


def admin_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    env = state.config.admin_token_env

    @router.get("/tokenizer")
    async def tokenizer() -> dict:
        hf = state.client.tokenizer.hf
        return {"tokenizer_json": hf.backend_tokenizer.to_str(), "chat_template": getattr(hf, "chat_template", None),
                "bos_token": hf.bos_token, "eos_token": hf.eos_token, "model": state.config.model.name}

    @router.post("/admin/drain")
    async def drain(request: Request) -> JSONResponse:
        refused = check_bearer(request.headers.get("authorization"), admin_token(env), env)
        if refused is not None:
            return JSONResponse(error_body(refused[1], "unauthorized", refused[0]), status_code=refused[0])
        mode = await _drain_mode(request)
        if mode is None:
            return JSONResponse(error_body('the body must be empty or {"mode": "wait" | "move_kv"}',
                                           "invalid_request_error", 400, "mode"), status_code=400)
        state.client.drain(move_kv=mode == "move_kv")
        return JSONResponse({"state": state.client.state.value, "mode": mode})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        refused = check_bearer(request.headers.get("authorization"), admin_token(env), env)
        if refused is not None:
            return JSONResponse(error_body(refused[1], "unauthorized", refused[0]), status_code=refused[0])
        try:
            freed = await state.client.reset_prefix_cache()
        except (EngineDeadError, TimeoutError) as err:
            return JSONResponse(error_body(f"cannot reset the prefix cache: {err or 'timed out'}",
                                           "service_unavailable", 503), status_code=503)
        return JSONResponse({"freed_blocks": freed})

    return router


async def _drain_mode(request: Request) -> str | None:
    """``"wait"`` (empty body or no ``mode``) or ``"move_kv"``; None for anything else."""
    raw = await request.body()
    if not raw.strip():
        return "wait"
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    mode = doc.get("mode", "wait") if isinstance(doc, dict) and set(doc) <= {"mode"} else None
    return mode if mode in ("wait", "move_kv") else None
