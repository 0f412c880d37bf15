"""Structured output checked at a server's HTTP frontend, before any engine work.

A spec the grammar library cannot compile is a 400 whose message is the library's reason. Only
the grammar is validated here (fast, cached, and it needs no view of the vocabulary, which would
cost each frontend process ~1-2 s and, in part, the GIL); the engine replays a ``generation_only``
request's output so far (the ctx server's first tokens, a migrated stream's tokens) through its
matcher and ends the request with ``"abort"`` if the grammar refuses one (logged).
"""
from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, GrammarError
from executor.openai_adapter import BadRequest

# the request fields that carry a spec (pdserve.structured_output.spec_of), for the error's param
SPEC_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")


def _spec_field(body) -> str | None:
    return next((f for f in SPEC_FIELDS if getattr(body, f, None) is not None), None)


def check_structured_output(compiler: GrammarCompiler, body, params: SamplingParams) -> None:
    """Compile ``params.structured_output`` (nothing to do without one; ``body``: the OpenAI
    request, for the error's ``param``). Raises :class:`BadRequest` (HTTP 400)."""
    if params.structured_output is None:
        return
    try:
        compiler.compile(params.structured_output)
    except GrammarError as err:
        raise BadRequest(str(err), _spec_field(body)) from None
