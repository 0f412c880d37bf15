"""Per-request sampling and stopping parameters."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    max_tokens: output tokens at most (None = up to max_model_len).
    temperature: 0 => greedy argmax. top_p in (0, 1]; top_k <= 0 disables top-k.
    seed: output token i is drawn with noise keyed by (seed, choice, i) (engine.sampler), taken
        modulo 2**64; None = a random seed given at admission.
    stop: strings that end the output (excluded from the text); stop_token_ids: ids that end it.
    ignore_eos: keep generating after the model's EOS ids.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
