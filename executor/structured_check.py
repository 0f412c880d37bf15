"""Structured output checked at a server's HTTP frontend, before any engine work.

A spec the grammar library cannot compile is a 400 whose message is the library's reason; so is a
``generation_only`` request whose output so far (the ctx server's first tokens, or a migrated
stream's tokens) the grammar does not allow. Validating a grammar needs no vocabulary; replaying
tokens does (the library's view of it is built once per process, ~1-2 s), so that runs in a
worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio

from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, GrammarError, TokenRejected
from executor.openai_adapter import BadRequest
from pdserve.protocol import DisaggregatedParams

# the request fields that carry a spec (pdserve.structured_output.spec_of), for the error's param
SPEC_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")


def _spec_field(body) -> str | None:
    return next((f for f in SPEC_FIELDS if getattr(body, f, None) is not None), None)


async def check_structured_output(compiler: GrammarCompiler, body, params: SamplingParams,
                                  disagg: DisaggregatedParams | None) -> None:
    """Compile ``params.structured_output`` (nothing to do without one) and replay the output
    tokens a ``generation_only`` request already has (``body``: the OpenAI request, for the
    error's ``param``). Raises :class:`BadRequest` (HTTP 400)."""
    spec = params.structured_output
    if spec is None:
        return
    tokens: list[int] = []
    if disagg is not None and disagg.request_type == "generation_only" and not disagg.awaits_ctx:
        tokens = list(disagg.first_gen_tokens or [])
    try:
        compiler.compile(spec)  # no vocabulary needed: fast, and cached
        if tokens:  # replaying them needs the vocabulary view (built once, ~1-2 s): off the event loop
            await asyncio.to_thread(compiler.matcher, spec, tokens)
    except TokenRejected as err:
        raise BadRequest(str(err), "disaggregated_params.first_gen_tokens") from None
    except GrammarError as err:
        raise BadRequest(str(err), _spec_field(body)) from None
