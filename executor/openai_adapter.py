"""OpenAI bodies ↔ engine requests and outputs (no HTTP here).

Defaults follow the OpenAI API: temperature 1.0, top_p 1.0; ``/v1/completions`` max_tokens 16;
``/v1/chat/completions`` without max_tokens generates up to the context window. A temperature
below :data:`MIN_TEMPERATURE` samples greedily (as in vLLM): dividing logits by 1e-300 overflows
to inf, and the NaN probabilities that follow would fail the engine step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprob
from engine.request import EngineRequest, Phase, RequestOutput
from engine.sampling_params import SamplingParams
from executor.logprobs_format import (TokenNamer, chat_logprobs, completion_logprobs, from_wire, join_completion,
                                      prompt_first)
from pdserve.chat_template import hf_messages, template_tools
from pdserve.structured_output import StructuredOutputSpec
from pdserve.output_parser import OutputParser
from pdserve.tool_use import NO_TOOLS, ToolError, ToolUse, check_template_kwargs, tool_use
from pdserve.protocol import (
    RELAY_LINE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionResponse,
    DisaggregatedParams,
    PromptTokensDetails,
    ToolCall,
    Usage,
)


MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS


class BadRequest(ValueError):
    """The body is valid JSON of the right shape but cannot be served (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def sampling_params(body: ChatCompletionRequest | CompletionRequest, tools: ToolUse = NO_TOOLS) -> SamplingParams:
    """The engine's sampling parameters for an OpenAI body. Raises :class:`BadRequest` for what
    the schema accepts but this server cannot do (``best_of`` > 1, ``min_tokens`` > ``max_tokens``).

    ``tools`` (:func:`request_tool_use`): a forced choice (``required``, a named function)
    constrains the output to its call's JSON Schema (a structured-output spec, as
    ``response_format`` would; the two together are a 400)."""
    chat = isinstance(body, ChatCompletionRequest)
    if not chat and body.best_of is not None and body.best_of > 1:
        raise BadRequest("best_of > 1 is not supported (each request returns the one choice it samples)", "best_of")
    max_tokens = body.effective_max_tokens()
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", "min_tokens")
    k = body.logprobs_k()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_temperature(body.temperature),
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens,
        logit_bias=body.token_bias(),
        logprobs=k,
        prompt_logprobs=k if not chat and body.echo else None,
        structured_output=_output_spec(body, tools),
    )


def _output_spec(body: ChatCompletionRequest | CompletionRequest, tools: ToolUse) -> StructuredOutputSpec | None:
    spec = body.structured_output_spec()
    if tools.mode != "forced":
        return spec
    if spec is not None:
        raise BadRequest("tool_choice required or a named function constrains the output to a call; it cannot be "
                         "combined with response_format or guided_* fields", "tool_choice")
    return StructuredOutputSpec(kind="json_schema", json_schema=tools.schema)


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    return 0.0 if value < MIN_TEMPERATURE else value


def prompt_token_ids(body: ChatCompletionRequest | CompletionRequest, tokenizer, vocab_size: int) -> list[int]:
    """Tokenize the prompt (chat template for chat bodies). Raises :class:`BadRequest`."""
    if isinstance(body, ChatCompletionRequest):
        ids = chat_prompt_ids(body, tokenizer)
    elif isinstance(body.prompt, str):
        ids = tokenizer.encode(body.prompt)
    else:
        ids = list(body.prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty after tokenization", "prompt")
    return ids


def chat_prompt_ids(body, tokenizer) -> list[int]:
    """A chat body (or a ``/tokenize`` chat body) rendered by the chat template with its ``tools``
    and ``chat_template_kwargs`` (:mod:`pdserve.chat_template`), tokenized. Raises :class:`BadRequest`."""
    try:
        check_template_kwargs(body.chat_template_kwargs)
        messages = hf_messages([m.model_dump(exclude_none=True) for m in body.messages])
    except ToolError as err:
        raise BadRequest(str(err), err.param) from None
    except ValueError as err:
        raise BadRequest(str(err), "messages") from None
    tools = template_tools([t.model_dump() for t in body.tools]) if body.tools else None
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=tools, template_kwargs=body.chat_template_kwargs)
    except ValueError as err:
        raise BadRequest(str(err), "messages") from None


def request_tool_use(body: ChatCompletionRequest | CompletionRequest) -> ToolUse:
    """What ``tools``/``tool_choice`` ask (:func:`pdserve.tool_use.tool_use`); completions have none.
    Raises :class:`BadRequest` (400) for a choice naming no tool, a bad ``parameters`` schema, ..."""
    if not isinstance(body, ChatCompletionRequest):
        return NO_TOOLS
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    try:
        return tool_use([t.model_dump() for t in body.tools] if body.tools else None, choice)
    except ToolError as err:
        raise BadRequest(str(err), err.param) from None


def check_length(num_prompt_tokens: int, max_model_len: int, param: str = "messages") -> None:
    """Raises :class:`BadRequest` if the prompt leaves no room for one output token."""
    if num_prompt_tokens >= max_model_len:
        raise BadRequest(
            f"the prompt has {num_prompt_tokens} tokens; this model's context window is {max_model_len} tokens "
            f"(prompt + output), so at most {max_model_len - 1} prompt tokens fit", param)


PHASES = {
    "context_and_generation": Phase.CONTEXT_AND_GENERATION,
    "context_only": Phase.CONTEXT_ONLY,
    "generation_only": Phase.GENERATION_ONLY,
}


def engine_request(request_id: str, prompt: list[int], params: SamplingParams,
                   disagg: DisaggregatedParams | None, cache_salt: str | None = None, n: int = 1) -> EngineRequest:
    """Build the engine request for a body's phase (colocated when ``disagg`` is None).

    ``generation_only`` reports the ctx server's prefix-cache hit (``disagg.cached_tokens``) and
    names the ctx blocks by hash (``disagg.kv_block_hashes``: partial pulls, engine.kv_connector);
    a moved request's pull covers ``disagg.kv_num_tokens`` tokens. ``disagg.movable``: the request
    may be moved off this server when it drains with ``move_kv`` (n > 1: each choice under its own lease, or handed back when one cannot be parked). ``n`` choices: a ``generation_only`` request's ``first_gen_tokens`` /
    ``first_gen_logprobs`` then hold one entry per choice, in choice order (the ctx server's answer,
    engine.choices). ``disagg.choice_index`` (n = 1): the request continues that choice of an n > 1
    request and samples as it (engine.request.EngineRequest.choice_index)."""
    phase = PHASES[disagg.request_type] if disagg else Phase.CONTEXT_AND_GENERATION
    gen_only = disagg is not None and phase == Phase.GENERATION_ONLY
    later = gen_only and disagg.awaits_ctx  # generation_first: first tokens and cache hit come with the KV
    first = list(disagg.first_gen_tokens) if gen_only and not later else None
    cached = (disagg.cached_tokens or 0) if gen_only else 0
    hashes = [bytes.fromhex(h) for h in disagg.kv_block_hashes] if gen_only and disagg.kv_block_hashes else None
    first_lp = from_wire(disagg.first_gen_logprobs) if gen_only else None
    prompt_lp = from_wire(disagg.prompt_logprobs) if gen_only else None
    return EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params,
                         phase=phase, first_token_ids=first, cache_salt=cache_salt, num_cached_tokens=cached,
                         first_token_logprobs=first_lp, prompt_logprobs=prompt_lp,
                         source_block_hashes=hashes, first_tokens_later=later, n=n,
                         movable=bool(disagg and disagg.movable),
                         kv_num_tokens=disagg.kv_num_tokens if gen_only and not later else None,
                         choice_index=(disagg.choice_index or 0) if disagg else 0)


@dataclass
class Shape:
    """What a response adds besides text: ``logprobs`` (top-k per token, None = none), completions
    ``echo`` (the prompt text to prefix, with ``prompt_ids`` for its logprobs), ``namer`` (token
    text), ``continuous_usage`` (usage on every streamed chunk, vLLM's ``continuous_usage_stats``),
    ``parsers`` (chat: choice index → the parser of that choice's text → reasoning_content / content
    / tool_calls, one per choice since each holds its own parse state; absent: as is)."""

    logprobs: int | None = None
    echo: str | None = None
    prompt_ids: list[int] | None = None
    namer: TokenNamer | None = None
    continuous_usage: bool = False
    parsers: dict[int, OutputParser] = field(default_factory=dict)  # pdserve.output_parser

    def parser_of(self, index: int) -> OutputParser | None:
        """Choice ``index``'s output parser (None: its text goes to the client as is)."""
        return self.parsers.get(index)


def response_shape(body: ChatCompletionRequest | CompletionRequest, prompt: list[int], tokenizer) -> Shape:
    """The :class:`Shape` of ``body``'s answer (``prompt``: its token ids)."""
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)
    opts = body.stream_options
    return Shape(logprobs=body.logprobs_k(), echo=echo, prompt_ids=prompt,
                 namer=TokenNamer(tokenizer, body.return_tokens_as_token_ids),
                 continuous_usage=bool(opts and opts.continuous_usage_stats))


@dataclass
class Accumulated:
    """The running total of one request's outputs (for non-stream answers and usage)."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.logprobs += out.new_logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
                     total_tokens=self.num_prompt_tokens + self.num_output_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens))


class Choices:
    """Every choice's :class:`Accumulated` of one request (``n`` > 1: one per ``RequestOutput.index``)."""

    def __init__(self) -> None:
        self.by_index: dict[int, Accumulated] = {}

    def add(self, out: RequestOutput) -> Accumulated:
        """Add ``out`` to its choice's total; returns that total."""
        acc = self.by_index.setdefault(out.index, Accumulated())
        acc.add(out)
        return acc

    def ordered(self) -> list[Accumulated]:
        return [self.by_index[i] for i in sorted(self.by_index)] or [Accumulated()]

    def usage(self) -> Usage:
        """OpenAI's usage of n choices: the prompt once, completion tokens summed over the choices."""
        accs = self.ordered()
        prompt, done = accs[0].num_prompt_tokens, sum(a.num_output_tokens for a in accs)
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=accs[0].num_cached_tokens))


def full_response(chat: bool, rid: str, created: int, model: str, choices: Choices,
                  disagg: DisaggregatedParams | None, shape: Shape | None = None
                  ) -> ChatCompletionResponse | CompletionResponse:
    """The non-stream answer: one choice per index (``disagg``, the ctx answer's params, on choice 0)."""
    shape = shape or Shape()
    out = []
    for i, acc in sorted(choices.by_index.items()) or [(0, Accumulated())]:
        text, params = "".join(acc.text), disagg if not out else None
        if chat:
            lp = chat_logprobs(acc.logprobs, shape.namer) if shape.logprobs is not None else None
            message, finish = ChatResponseMessage(content=text), acc.finish_reason
            parser = shape.parser_of(i)
            if parser is not None and acc.finish_reason is not None:  # a ctx answer not final stays raw
                message, finish = parsed_message(parser, text), parser.finish_reason(acc.finish_reason)
            out.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                  disaggregated_params=params, logprobs=lp))
        else:
            lp, _ = completion_logprobs_of(shape, acc.prompt_logprobs, acc.logprobs, 0)
            out.append(CompletionChoice(index=i, text=(shape.echo or "") + text, finish_reason=acc.finish_reason,
                                        disaggregated_params=params, logprobs=lp))
    cls = ChatCompletionResponse if chat else CompletionResponse
    return cls(id=rid, created=created, model=model, choices=out, usage=choices.usage())


def parsed_message(parser: OutputParser, text: str) -> ChatResponseMessage:
    """The message of a whole answer ``text`` read by ``parser`` (fed once, then finished)."""
    parser.feed(text)
    parser.finish()
    parts = parser.message()
    calls = [ToolCall.model_validate(c) for c in parts["tool_calls"]] if parts["tool_calls"] else None
    return ChatResponseMessage(content=parts["content"], reasoning_content=parts["reasoning_content"], tool_calls=calls)


def completion_logprobs_of(shape: Shape, prompt_lp: list[TokenLogprob | None] | None,
                           output_lp: list[TokenLogprob], offset: int) -> tuple[dict | None, int]:
    """Completions logprobs for an echoed prompt (when ``prompt_lp`` is given and echo is on) and
    output tokens; (None, offset) without logprobs."""
    if shape.logprobs is None:
        return None, offset
    if shape.echo is not None and prompt_lp is not None and shape.prompt_ids:
        head, offset = prompt_first(prompt_lp, shape.prompt_ids, shape.namer, offset)
        tail, offset = completion_logprobs(output_lp, shape.namer, offset)
        return join_completion(head, tail), offset
    return completion_logprobs(output_lp, shape.namer, offset)


def chunk(chat: bool, rid: str, created: int, model: str, text: str | None, finish_reason: str | None,
          role: bool = False, usage: Usage | None = None) -> ChatCompletionChunk | CompletionChunk:
    """One streamed chunk; ``usage`` set and ``text`` None makes the final usage-only chunk (no choices)."""
    if usage is not None and text is None:
        cls = ChatCompletionChunk if chat else CompletionChunk
        return cls(id=rid, created=created, model=model, choices=[], usage=usage)
    if chat:
        delta = ChatDelta(role="assistant" if role else None, content=text)
        return ChatCompletionChunk(id=rid, created=created, model=model,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
    return CompletionChunk(id=rid, created=created, model=model,
                           choices=[CompletionChunkChoice(text=text or "", finish_reason=finish_reason)])


_RELAY = RELAY_LINE.decode()


def _dumps(value: object) -> str:
    """Compact JSON with raw UTF-8, as pydantic's ``model_dump_json`` writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ChunkEncoder:
    """The SSE events of one stream, built as strings: no pydantic model per chunk.

    Byte-for-byte what ``sse_event(chunk(...))`` writes (tested): the per-request head (id,
    object, created, model) is encoded once, each chunk encodes only its text and finish reason.
    """

    def __init__(self, chat: bool, rid: str, created: int, model: str) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_dumps(rid)},"object":"{obj}","created":{int(created)},'
                      f'"model":{_dumps(model)},"choices":[')

    def event(self, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: dict | None = None, usage: Usage | None = None,
              token_ids: list[int] | None = None, index: int = 0, delta: dict | None = None) -> bytes:
        """One content chunk (``role`` marks the first chat chunk with ``"assistant"``; ``logprobs``:
        the choice's logprobs object; ``usage``: continuous usage stats; ``index``: the choice, n > 1).

        ``token_ids`` (when not None) adds the extension field ``"token_ids"`` to the choice: the
        output token ids this chunk's text came from (``disaggregated_params.stream_token_ids``).
        ``delta`` (chat, when an output parser runs): the delta's fields instead of ``text``
        (:meth:`pdserve.output_parser.ParsedDelta.to_openai`)."""
        lp = "null" if logprobs is None else _dumps(logprobs)
        use = "null" if usage is None else _dumps(usage.model_dump())
        ids = "" if token_ids is None else f'"token_ids":{_dumps(token_ids)},'
        end = f'{ids}"finish_reason":{_dumps(finish_reason)},"logprobs":{lp}}}],"usage":{use}}}\n\n'
        if self.chat and delta is not None:
            head = {"role": "assistant"} if role else {}
            choice = f'{{"index":{int(index)},"delta":{_dumps({**head, **delta})},'
        elif self.chat:
            role_json = '"role":"assistant",' if role else ""  # later deltas leave role out, as OpenAI's
            choice = f'{{"index":{int(index)},"delta":{{{role_json}"content":{_dumps(text)}}},'
        else:
            choice = f'{{"index":{int(index)},"text":{_dumps(text or "")},'
        return (self._head + choice + end).encode()

    def relay_event(self, text: str, finish_reason: str | None, start: int, token_ids: list[int]) -> bytes:
        """One pass-through event (``disaggregated_params.relay_head``): the
        :data:`pdserve.protocol.RELAY_LINE` record ``[start, start + len(text), token_ids,
        finish_reason]`` (``start``: characters of output text before ``text``), then the client's
        chunk (no role) when it has text or a finish reason; the record alone otherwise."""
        record = f'{_RELAY}[{start},{start + len(text)},{_dumps(token_ids)},{_dumps(finish_reason)}]\n'
        if not text and finish_reason is None:
            return (record + "\n").encode()
        return record.encode() + self.event(text, finish_reason)

    def usage_event(self, usage: Usage) -> bytes:
        """The final usage-only chunk (no choices)."""
        return (self._head + f'],"usage":{_dumps(usage.model_dump())}}}\n\n').encode()
