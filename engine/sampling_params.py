"""Per-request sampling and stopping parameters."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.structured_output import StructuredOutputSpec

MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's chat limit; vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    max_tokens: output tokens at most (None = up to max_model_len).
    temperature: 0 => greedy argmax. top_p in (0, 1]; top_k <= 0 disables top-k.
    seed: output token i is drawn with noise keyed by (seed, choice, i) (engine.sampler), taken
        modulo 2**64; None = a random seed given at admission.
    stop: strings that end the output (excluded from the text); stop_token_ids: ids that end it.
    ignore_eos: keep generating after the model's EOS ids.

    Logits processors (engine.logits_processors; OpenAI / vLLM semantics), applied to the raw
    logits in this order before greedy or sampled picking:
    logit_bias: token id -> bias added to its logit (OpenAI: in [-100, 100]).
    min_tokens: until this many output tokens exist, EOS and stop_token_ids cannot be sampled and
        stop strings do not end the output.
    repetition_penalty (> 0, 1 = off; CTRL, Keskar et al. 2019, as in HF/vLLM): a token of the prompt
        or output so far has its logit divided by it when positive, multiplied when negative.
    frequency_penalty, presence_penalty (in [-2, 2], 0 = off; OpenAI): logit -= frequency * count
        of the token in the output so far + presence * (count > 0).
    min_p (in [0, 1], 0 = off): after temperature, tokens whose probability is below min_p times
        the most likely token's are dropped.

    logprobs: None = none; k >= 0: each output token's log-probability plus the k most likely
        alternatives, from the raw logits (log-softmax before any processor or temperature: vLLM's
        default). prompt_logprobs: the same for every prompt token but the first (completions
        ``echo`` with ``logprobs``); such a request never starts from the prefix cache.

    structured_output: None = unconstrained; else the grammar every output token must keep
        (pdserve.structured_output; compiled by engine.structured_output into a token mask applied
        after the logits processors, before temperature and filters; EOS is allowed only where
        the grammar accepts). Logprobs stay those of the raw logits.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputSpec | None = None

    def validate(self) -> None:
        """Raise ValueError when a field is out of range."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._validate_processors()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    def _validate_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any(not -100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def processed(self) -> bool:
        """Whether any logits processor other than min_p applies (min_p acts on sampled rows only)."""
        return self.penalized or self.min_tokens > 0 or bool(self.logit_bias)
