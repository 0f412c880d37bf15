"""HTTP wire formats shared by the orchestrator and the ctx/gen servers.

The request and response bodies follow the OpenAI API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``; https://platform.openai.com/docs/api-reference).
``disaggregated_params`` is pdserve's extension (same name and role as in TensorRT-LLM's
``trtllm-serve disaggregated``): the orchestrator adds it to route the two phases of a request.

Imports only pydantic: the orchestrator never imports torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_serializer,
                      model_validator)

from pdserve.tool_protocol import MAX_TOOLS, Tool, ToolCall, ToolChoice

from pdserve.structured_output import ResponseFormat, StructuredOutputSpec, StructuredOutputsParams, spec_of

RequestType = Literal["context_only", "generation_only", "context_and_generation"]

# Integer bounds of the wire: every integer a client sends fits a signed 64-bit word (OpenAI's
# ``seed`` is int64), every token id a signed 32-bit one (no vocabulary comes near 2**31), so no
# huge integer (2**70) reaches code that packs, hashes or indexes with it.
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Positive = Annotated[int, Field(ge=1, le=INT64_MAX)]
TokenIdLax = Annotated[int, Field(ge=0, le=2**31 - 1)]  # where a lax int was accepted before ("5", 5.0)
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
# Where a ctx rank serves its parked blocks: ``tcp://host:port`` or ``ucx://<worker address>``.
BlockHashHex = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]  # pdserve.block_hash: 16 bytes, hex
KVEndpoint = Annotated[str, Field(pattern=r"^(tcp|ucx)://\S+$", max_length=65536)]  # UCX worker addresses run to kilobytes
# generation_first: the ctx server a gen server waits on (its HTTP base URL, no path).
CtxURL = Annotated[str, Field(pattern=r"^https?://[^/\s]+$", max_length=2048)]


class KVLayoutModel(BaseModel):
    """The KV cache layout of one server rank (compared at the KV handshake).

    ``bytes_per_block`` = num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    num_layers: Positive
    num_kv_heads: Positive
    head_dim: Positive
    block_size: Positive
    dtype: str
    tp_rank: Count = 0
    tp_size: Positive = 1

    @model_validator(mode="after")
    def _rank_in_group(self) -> "KVLayoutModel":
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not a rank of a group of {self.tp_size}")
        return self


# The last event of a movable n > 1 stream handed back by a gen server draining with move_kv (its
# choices' KV freed, not parked; the orchestrator continues each choice elsewhere by prefilling again).
HANDED_BACK_EVENT = {"moved": {"handed_back": True}}
# The last event of a movable n > 1 stream moved choice by choice by a gen server draining with
# move_kv: {"moved": {MOVED_CHOICES_KEY: [params, ...]}}, one lease's disaggregated_params per
# unfinished choice (``choice_index``, ``ctx_request_id`` "<request id>-c<i>", ``first_gen_tokens``,
# ``kv_num_tokens``, ...); the orchestrator continues each as an n = 1 pull of that lease.
MOVED_CHOICES_KEY = "choices"

MAX_CHOICES = 16  # `n` at most; the engine's limit (engine.request.MAX_CHOICES) is the same

# A pass-through stream's record line (``disaggregated_params.relay_head``): an SSE comment
# ``:pd [start, end, [token ids], finish_reason]`` before each event's ``data:`` line (or alone,
# for tokens whose text is held back). ``start``/``end``: the event's text as character offsets of
# the output text (which starts with ``first_gen_tokens``' text). Clients ignore comment lines (WHATWG
# HTML, "server-sent events"); the orchestrator strips them.
RELAY_LINE = b":pd "


class RelayHead(BaseModel):
    """The client-facing ``id`` and ``created`` (unix seconds) a pass-through stream's chunks carry."""

    model_config = ConfigDict(extra="forbid")
    id: Annotated[str, Field(min_length=1, max_length=128)]
    created: Annotated[int, Field(ge=0, strict=True)]


class DisaggregatedParams(BaseModel):
    """Phase routing of one request (request side: orchestrator → server; answer side: ctx → orchestrator).

    ctx answer: ``ctx_request_id``, ``first_gen_tokens`` (the first sampled token ids),
    ``prompt_token_ids``, ``kv_endpoint`` (opaque transceiver address), ``kv_layout``,
    ``kv_block_count``, ``lease_deadline`` (unix seconds), ``cached_tokens`` (prompt tokens the
    ctx server's prefix cache held; the gen server reports them in ``usage``) and
    ``kv_block_hashes`` (the prompt's full blocks named as every prefix cache names them,
    pdserve.block_hash, hex: a gen server reuses the leading ones it holds and pulls only the rest).
    With ``n`` > 1, ``first_gen_tokens`` and ``first_gen_logprobs`` hold one entry per choice, in
    choice order (what the ctx server sampled for each choice), and the gen server forks the n choices.
    The orchestrator forwards them to the gen server with ``request_type = "generation_only"``. A migrated stream's
    gen request carries every output token generated so far in ``first_gen_tokens`` (the gen server
    counts them as output: detokenized, stop-checked and in ``usage``, and decodes on from there).

    generation_first (``orchestrator.schedule_style``): the gen request goes out with the ctx
    request and carries only ``disagg_request_id`` and ``ctx_url`` (the ctx server's base URL); the
    gen server allocates, asks ``POST {ctx_url}/disagg/lease`` for the rest (``pdserve.kv_wait``)
    and then pulls as above.
    """

    model_config = ConfigDict(extra="forbid")
    request_type: RequestType
    disagg_request_id: str | None = None
    ctx_request_id: str | None = None
    first_gen_tokens: list[TokenIdLax] | None = None
    prompt_token_ids: list[TokenIdLax] | None = None
    kv_endpoint: KVEndpoint | None = None
    kv_layout: KVLayoutModel | None = None
    kv_endpoints: list[KVEndpoint] | None = None   # one per ctx TP rank (rank order); [0] == kv_endpoint
    kv_layouts: list[KVLayoutModel] | None = None  # one per ctx TP rank; [0] == kv_layout
    kv_block_count: Count | None = None
    lease_deadline: float | None = None
    cached_tokens: Count | None = Field(None, description="ctx answer: prompt tokens its prefix cache held")
    kv_block_hashes: list[BlockHashHex] | None = Field(
        None, description="ctx answer: hashes of the prompt's full KV blocks, in order (partial pulls)")
    first_gen_logprobs: list["TokenLogprobModel"] | None = Field(
        None, description="ctx answer: logprobs of first_gen_tokens (the request asked for logprobs)")
    prompt_logprobs: list["TokenLogprobModel | None"] | None = Field(
        None, description="ctx answer: prompt logprobs (echo with logprobs); None for the first prompt token")
    stream_token_ids: StrictBool | None = Field(
        None, description="request side: a streamed answer carries each chunk's new output token ids in "
                          "`choices[0].token_ids` (the orchestrator strips them; it keeps them to migrate a stream)")
    ctx_url: CtxURL | None = Field(None, description="generation_first: the ctx server to wait on for the rest")
    movable: StrictBool | None = Field(
        None, description="request side (streams only): if this server drains with move_kv, the stream may end "
                          "with a `moved` event (the request's KV parked here for another gen server to pull; "
                          "n > 1: one lease per unfinished choice, MOVED_CHOICES_KEY; HANDED_BACK_EVENT, no KV parked, "
                          "when a choice cannot be parked)")
    kv_num_tokens: Count | None = Field(
        None, description="moved request: the lease holds the KV of this many tokens (prompt + first_gen_tokens "
                          "but the last), not only the prompt's")
    choice_index: Annotated[int, Field(ge=0, lt=MAX_CHOICES, strict=True)] | None = Field(
        None, description="request side, n = 1 only: this request continues choice `choice_index` of an n > 1 "
                          "request (a migrated or moved choice): it samples with that choice index and its chunks "
                          "carry `index: choice_index`; in a moved event's `choices` entries: the choice whose "
                          "KV that lease holds")
    raw_output: StrictBool | None = Field(
        None, description="request side: the caller assembles the client's text itself and parses tool calls and "
                          "reasoning out of it (pdserve.output_parser); the server streams the text unparsed")
    relay_head: RelayHead | None = Field(
        None, description="request side (generation_only streams): stream pass-through events, the chunks as the "
                          "client gets them (this id and created, no role, no token_ids field) each after a "
                          "RELAY_LINE record of its text offsets, token ids and finish reason; a server may ignore "
                          "it where it cannot (n > 1, logprobs, echo, continuous usage, a parser of its own), "
                          "then it streams as without it")

    @property
    def awaits_ctx(self) -> bool:
        """A generation_first gen request: the ctx state comes later, from ``ctx_url``."""
        return self.request_type == "generation_only" and self.ctx_request_id is None and self.ctx_url is not None

    @model_validator(mode="after")
    def _generation_only_has_ctx_state(self) -> "DisaggregatedParams":
        if self.awaits_ctx:
            if not self.disagg_request_id:
                raise ValueError("a generation_only request with ctx_url (generation_first) needs disagg_request_id")
            return self
        if self.request_type == "generation_only":
            missing = [k for k in ("ctx_request_id", "first_gen_tokens", "prompt_token_ids", "kv_endpoint", "kv_layout")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(f"generation_only requests need {', '.join(missing)} (from the ctx server's answer)")
            self._check_kv_source()
        return self

    def _check_kv_source(self) -> None:
        """One endpoint per ctx rank, layouts in rank order, no more blocks than the prompt fills and no
        more cached tokens than the prompt has (the gen server reports them in ``usage``)."""
        layouts = self.kv_layouts if self.kv_layouts is not None else [self.kv_layout]
        endpoints = self.kv_endpoints if self.kv_endpoints is not None else [self.kv_endpoint]
        if not layouts or len(endpoints) != len(layouts):
            raise ValueError(f"{len(endpoints)} kv_endpoints for {len(layouts)} kv_layouts: one of each per ctx TP rank")
        if any(x.tp_rank != i or x.tp_size != len(layouts) for i, x in enumerate(layouts)):
            raise ValueError(f"kv_layouts must be ranks 0..{len(layouts) - 1} of a group of {len(layouts)}, in order")
        block_size = layouts[0].block_size
        prompt = len(self.prompt_token_ids or [])
        if self.kv_num_tokens is not None and not prompt <= self.kv_num_tokens < prompt + len(self.first_gen_tokens or []):
            raise ValueError(f"kv_num_tokens {self.kv_num_tokens} is outside [{prompt} prompt tokens, prompt + "
                             f"first_gen_tokens - 1]")
        kv_tokens = self.kv_num_tokens or prompt
        needed = -(-kv_tokens // block_size)
        if self.kv_block_count is not None and self.kv_block_count > needed:
            raise ValueError(f"kv_block_count {self.kv_block_count} is more than the {needed} blocks "
                             f"{kv_tokens} tokens fill")
        if self.kv_block_hashes is not None and len(self.kv_block_hashes) > kv_tokens // block_size:
            raise ValueError(f"{len(self.kv_block_hashes)} kv_block_hashes for the "
                             f"{kv_tokens // block_size} full blocks of {kv_tokens} tokens")
        if self.cached_tokens is not None and self.cached_tokens > len(self.prompt_token_ids or []):
            raise ValueError(f"cached_tokens {self.cached_tokens} is more than the "
                             f"{len(self.prompt_token_ids or [])} prompt tokens")


class TokenLogprobModel(BaseModel):
    """One position's logprobs on the ctx → gen wire: the token, its logprob and the top
    ``(token id, logprob)`` pairs (what :class:`engine.logprobs.TokenLogprob` holds)."""

    model_config = ConfigDict(extra="forbid")
    token_id: TokenIdLax
    logprob: float
    top: list[tuple[TokenIdLax, float]] = Field(default_factory=list, max_length=20)


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with usage; ``continuous_usage_stats`` (vLLM's): usage on
    every chunk; ``include_obfuscation`` (OpenAI's) is accepted and changes nothing here."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool | None = None


MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's chat limit, vLLM's default max_logprobs)


class _SamplingFields(BaseModel):
    """Fields common to both endpoints. Unsupported features are accepted only at their defaults.

    Accepted and ignored (they change nothing a server computes): ``user`` (but see
    ``orchestrator.session_affinity``), ``metadata``, ``store``, ``parallel_tool_calls``,
    ``service_tier``, ``safety_identifier``, ``prompt_cache_key``. Any other unknown field is a 422.
    """

    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="pdserve extension; -1/0 = disabled")
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenIdLax] | None = None
    stream: StrictBool = False  # strict: "false" must not pass for a boolean (it would be truthy elsewhere)
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices: one prefill, n decodes (at most 16)")
    ignore_eos: StrictBool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=1e6, description="vLLM's field; 1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM's field; 0 = off")
    min_tokens: Count = Field(0, description="vLLM's field: no EOS / stop before this many output tokens")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=300)
    return_tokens_as_token_ids: StrictBool = Field(False, description="vLLM's field: logprob tokens as 'token_id:N'")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: str | None = Field(None, max_length=64)
    safety_identifier: str | None = Field(None, max_length=512)
    prompt_cache_key: str | None = Field(None, max_length=4096)
    cache_salt: str | None = Field(None, min_length=1, max_length=4096, description="vLLM's field: requests with different "
                                   "salts never share prefix-cache blocks (e.g. one salt per tenant)")
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text | json_object | json_schema")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's field: a JSON Schema the output matches")
    guided_regex: str | None = Field(None, description="vLLM's field: a regex the whole output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM's field: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's field: a Lark grammar the output matches")
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's newer form: one of json | regex | choice | grammar | json_object")
    disaggregated_params: DisaggregatedParams | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop takes at most 16 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # OpenAI and vLLM refuse stream_options on a non-streaming request rather than ignore them.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict | None) -> dict | None:
        for key in v or {}:
            if not key.isdigit() or int(key) > 2**31 - 1:
                raise ValueError(f"logit_bias keys are token ids (decimal strings), got {key[:20]!r}")
        return v

    @model_validator(mode="after")
    def _one_structured_output(self):
        self.structured_output_spec()  # raises ValueError (422) for two forms or a malformed payload
        return self

    def structured_output_spec(self) -> StructuredOutputSpec | None:
        """The request's structured-output constraint (pdserve.structured_output.spec_of), or None.
        Raises ValueError when the body carries more than one form or a malformed one."""
        return spec_of(self.response_format, self.guided_json, self.guided_regex, self.guided_choice,
                       self.guided_grammar, self.structured_outputs)

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by int token id (None when empty)."""
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


class ChatMessage(BaseModel):
    """One message of the history. ``content`` may be null only on an assistant message that
    carries ``tool_calls``; a ``tool`` message answers the call named by ``tool_call_id``;
    ``reasoning_content`` (an assistant's earlier thinking) reaches templates that read it."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_role(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only on an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return self

    def text(self) -> str:
        """The message text ("" for null content); list content must hold only ``{"type": "text",
        "text": ...}`` parts (ValueError otherwise)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description="none | auto | required | {type: function, function: "
                                           "{name}}; default auto with tools, none without")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's field: extra variables for the chat template (e.g. {\"enable_thinking\": false})")

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_k(self) -> int | None:
        """Top alternatives per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=INT64_MAX, description="only 1 (400 otherwise)")

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            return v
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            return v[0]
        raise ValueError("prompt must be one non-empty string or one list of token ids (batches are not supported)")

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens`` = prompt tokens whose KV came from
    the prefix cache (on the disaggregated path: the ctx server's cache)."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # {tokens, token_logprobs, top_logprobs, text_offset}
    disaggregated_params: DisaggregatedParams | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def _drop_null_extras(data: dict) -> dict:
    """Leave ``tool_calls`` / ``reasoning_content`` out of a message or delta when they are null, so
    an answer without tools or reasoning is written exactly as before they existed."""
    for key in ("tool_calls", "reasoning_content"):
        if data.get(key) is None:
            data.pop(key, None)
    return data


class ChatResponseMessage(BaseModel):
    """The answer's message: ``content`` (null when the answer is only tool calls), ``tool_calls``
    and ``reasoning_content`` (both left out when absent)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler) -> dict:
        return _drop_null_extras(handler(self))


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # {content: [{token, logprob, bytes, top_logprobs}], refusal}
    disaggregated_params: DisaggregatedParams | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    """One streamed delta; ``tool_calls`` holds OpenAI's partial calls (``index``; ``id``, ``type``
    and ``function.name`` in a call's first delta; ``function.arguments`` fragments)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler) -> dict:
        data = _drop_null_extras(handler(self))
        if data.get("role") is None:  # only the first delta names the role, as OpenAI streams it
            data.pop("role", None)
        return data


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with text (vLLM's shape): ``add_special_tokens`` defaults to true as in
    vLLM; ``return_token_strs`` adds each token's vocabulary string."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with chat messages, rendered by the model's chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    """``count`` = len(``tokens``); ``max_model_len``: the server's context window (tokens)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): token ids → text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    """``GET /version``: the pdserve distribution's version."""

    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def error_body(message: str, type_: str, code: int | str, param: str | None = None) -> dict:
    """The JSON body of an OpenAI-style error (``type_`` e.g. ``invalid_request_error``)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict) -> bytes:
    """One server-sent event line ``data: {json}\\n\\n``."""
    import json

    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n".encode()


DisaggregatedParams.model_rebuild()
