"""Client body validation at the orchestrator, with the shared :mod:`pdserve.request_body` rules.

Over :data:`~pdserve.request_body.MAX_BODY_BYTES` → 413; not strict JSON, not an object, too deep,
or carrying ``disaggregated_params`` → 400; schema violations → 422 naming the field path; a model
this cluster does not serve → 404 ``model_not_found``. Every error is an
:class:`~orchestrator.errors.OrchestratorError`.
"""

from __future__ import annotations

from pydantic import BaseModel

from pdserve.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.tool_use import NO_TOOLS, ToolError, ToolUse, check_template_kwargs, tool_use
from pdserve.request_body import (BodyError, StreamingRequest, decode_json, loc_path, read_limited, validate_request,
                                  validation_message)

from .errors import OrchestratorError

__all__ = ["REQUEST_MODELS", "loc_path", "parse_client_body", "read_client_body", "tools_of", "validation_message"]

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def body_error(err: BodyError) -> OrchestratorError:
    """The orchestrator's error for a refused body (same status, message and param)."""
    out = OrchestratorError(err.status, err.message, param=err.param, kind="bad_request")
    out.close_connection = err.close_connection
    return out


def parse_client_body(raw: bytes, endpoint: str, served_model: str) -> dict:
    """Validate a client body for ``endpoint`` and return it as a dict (the form forwarded upstream).

    Raises:
        OrchestratorError: 400 (bad JSON, not an object, disaggregated_params), 422 (schema), 404 (model).
    """
    try:
        body = decode_json(raw)
        if "disaggregated_params" in body:
            raise BodyError(400, "disaggregated_params is set by the orchestrator; clients must not send it",
                            "disaggregated_params")
        validate_request(body, REQUEST_MODELS[endpoint])
    except BodyError as err:
        raise body_error(err) from None
    if body["model"] != served_model:
        raise OrchestratorError(404, f"The model '{body['model']}' does not exist; this cluster serves "
                                     f"'{served_model}'", code="model_not_found", param="model", kind="bad_request")
    return body


def tools_of(endpoint: str, body: dict) -> ToolUse:
    """What a validated body's ``tools``/``tool_choice`` ask (:func:`pdserve.tool_use.tool_use`), with
    ``chat_template_kwargs`` checked too. Raises OrchestratorError 400 naming the field."""
    if not endpoint.endswith("/chat/completions"):
        return NO_TOOLS
    try:
        check_template_kwargs(body.get("chat_template_kwargs"))
        return tool_use(body.get("tools"), body.get("tool_choice"))
    except ToolError as err:
        raise OrchestratorError(400, str(err), param=err.param, kind="bad_request") from None


async def read_client_body(request: StreamingRequest, endpoint: str, served_model: str) -> dict:
    """Read (at most :data:`~pdserve.request_body.MAX_BODY_BYTES`) and validate a client body.

    Raises:
        OrchestratorError: 413 (too large; answered with ``Connection: close``) or as :func:`parse_client_body`.
    """
    try:
        raw = await read_limited(request)
    except BodyError as err:
        raise body_error(err) from None
    return parse_client_body(raw, endpoint, served_model)
