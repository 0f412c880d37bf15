"""Client body validation with the shared pdserve.protocol models.

Malformed JSON → 400; a body that is not an object or carries ``disaggregated_params`` → 400;
schema violations → 422 naming the field path; a model this cluster does not serve → 404
``model_not_found``. Every error is an :class:`~orchestrator.errors.OrchestratorError`.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from pdserve.protocol import ChatCompletionRequest, CompletionRequest

from .errors import OrchestratorError

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def loc_path(loc: tuple | list) -> str:
    """``("body", "messages", 0, "role")`` → ``messages.0.role``."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "<body>"


def validation_message(err: ValidationError | list[dict]) -> tuple[str, str | None]:
    """One ``path: problem`` line per error, and the first error's path (the OpenAI ``param``)."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    lines, first = [], None
    for e in errors:
        path = loc_path(e.get("loc", ()))
        msg = "unknown field" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
        lines.append(f"{path}: {msg}")
        first = first or path
    return "; ".join(lines) or "invalid request body", first


def parse_body(raw: bytes, endpoint: str, served_model: str) -> dict:
    """Validate a client body for ``endpoint`` and return it as a dict (the form forwarded upstream).

    Raises:
        OrchestratorError: 400 (bad JSON, not an object, disaggregated_params), 422 (schema), 404 (model).
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise OrchestratorError(400, f"request body is not valid JSON: {err}", kind="bad_request") from None
    if not isinstance(body, dict):
        raise OrchestratorError(400, f"request body must be a JSON object, got {type(body).__name__}",
                                kind="bad_request")
    if "disaggregated_params" in body:
        raise OrchestratorError(400, "disaggregated_params is set by the orchestrator; clients must not send it",
                                param="disaggregated_params", kind="bad_request")
    try:
        REQUEST_MODELS[endpoint].model_validate(body)
    except ValidationError as err:
        message, param = validation_message(err)
        raise OrchestratorError(422, message, param=param, kind="bad_request") from None
    if body["model"] != served_model:
        raise OrchestratorError(404, f"The model '{body['model']}' does not exist; this cluster serves "
                                     f"'{served_model}'", code="model_not_found", param="model", kind="bad_request")
    return body
