"""Token sampling: one batched, device-agnostic step with one host transfer (the sampled ids).

Semantics (OpenAI / vLLM): the logits processors of :mod:`engine.logits_processors` (logit_bias,
min_tokens, penalties) apply first, to greedy and sampled rows alike; temperature 0 is then greedy
argmax; otherwise logits are divided by the temperature, min_p drops the tokens whose probability
is below min_p times the largest, top-k keeps the k highest (exactly k, by rank), top-p keeps the
smallest prefix of the remaining tokens, in descending probability (softmax after top-k), whose
mass reaches top_p. A batch in which no row uses a processor or min_p takes exactly the path it
took before they existed (greedy stays bit-identical). A structured-output grammar
(:mod:`engine.grammar_mask`) then sets the logits of the tokens it disallows to -inf, before
temperature and filters: greedy is the argmax over the allowed tokens, sampling draws among them.

Randomness is the Gumbel-max trick (Gumbel 1954; e.g. Maddison, Tarlow and Minka, "A* Sampling",
NeurIPS 2014): ``argmax_v(logits_v / T + G_v)`` with i.i.d. standard Gumbel ``G_v`` is an exact
draw from ``softmax(logits / T)`` restricted to the kept tokens. ``G_v`` comes from
:mod:`engine.counter_rng`, a pure function of (seed, choice index, output position, token id v),
so a request draws the same tokens on any server, in any batch, split (ctx samples token 0, gen
the rest) or resumed anywhere. Masked tokens never need noise: filtering first and drawing noise
only for the candidates gives the same token as drawing it for the whole vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.counter_rng import as_int64, gumbel_argmax, stream_keys
from engine.grammar_mask import GrammarRows, apply_grammar
from engine.logits_processors import History, process_logits
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Rows:
    """Host-side view of the sampled (non-greedy) rows of one step, built from SamplingParams."""

    vocab: int                 # V
    index: list[int]           # rows of the logits that are sampled
    temperature: list[float]
    top_k: list[int]           # effective k per row, V when top-k is off
    top_p: list[float]
    min_p: list[float]
    seeds: list[int]           # int64 bit patterns
    choices: list[int]
    positions: list[int]

    @property
    def max_k(self) -> int:
        return max(self.top_k)

    @property
    def filtered(self) -> bool:
        return self.max_k < self.vocab or any(p < 1.0 for p in self.top_p)


def _rows(params: list[SamplingParams], positions: list[int], choices: list[int],
          vocab: int) -> _Rows:
    picked = [i for i, sp in enumerate(params) if not sp.greedy]
    for i in picked:
        if params[i].seed is None:
            raise ValueError("a sampled request needs a seed (the engine assigns one at admission)")
    return _Rows(vocab=vocab, index=picked,
                 temperature=[params[i].temperature for i in picked],
                 top_k=[params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in picked],
                 top_p=[params[i].top_p for i in picked],
                 min_p=[params[i].min_p for i in picked],
                 seeds=[as_int64(params[i].seed) for i in picked],
                 choices=[as_int64(choices[i]) for i in picked],
                 positions=[as_int64(positions[i]) for i in picked])


def _filter_candidates(scaled: torch.Tensor, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [B, V] -> (values [B, K], token ids [B, K]) in descending order, -inf where top-k
    or top-p drops a token. K = the largest top-k of the batch (one topk), or V (one sort)."""
    dev = scaled.device
    if rows.max_k < rows.vocab:
        values, ids = torch.topk(scaled, rows.max_k, dim=-1, sorted=True)
    else:
        values, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(values.shape[-1], device=dev)
    k = torch.tensor(rows.top_k, device=dev)
    values = values.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs   # mass of the tokens ranked above each one
    top_p = torch.tensor(rows.top_p, device=dev, dtype=probs.dtype)
    return values.masked_fill(before >= top_p[:, None], float("-inf")), ids


def _sample_rows(logits: torch.Tensor, rows: _Rows) -> torch.Tensor:
    """logits [S, V] float32 -> sampled token ids [len(rows.index)] int64 (on logits.device)."""
    dev = logits.device
    sub = logits.index_select(0, torch.tensor(rows.index, device=dev))
    scaled = sub / torch.tensor(rows.temperature, device=dev, dtype=sub.dtype)[:, None]
    if any(p > 0 for p in rows.min_p):  # p(v) < min_p * p_max  <=>  scaled_v < max + log(min_p)
        floor = torch.tensor(rows.min_p, device=dev, dtype=sub.dtype).log()[:, None]
        scaled = scaled.masked_fill(scaled < scaled.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    keys = stream_keys(torch.tensor(rows.seeds, device=dev), torch.tensor(rows.choices, device=dev),
                       torch.tensor(rows.positions, device=dev))
    if not rows.filtered:
        return gumbel_argmax(scaled, keys, torch.arange(scaled.shape[-1], device=dev))
    values, ids = _filter_candidates(scaled, rows)
    return ids.gather(1, gumbel_argmax(values, keys, ids)[:, None]).squeeze(1)


class Sampler:
    """Picks one token per row of logits; stateless (every draw is keyed, nothing is consumed).

    eos_token_ids: what ``min_tokens`` bans (with each request's stop_token_ids) until it is met.
    """

    def __init__(self, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def sample_ids(self, logits: torch.Tensor, params: list[SamplingParams],
                   output_indices: list[int], choice_indices: list[int] | None = None,
                   history: list[History] | None = None, grammar: GrammarRows | None = None) -> torch.Tensor:
        """One token id per row, as an int64 tensor [S] on logits.device (no host transfer).

        logits: [S, V] float32 on any device; params[i]: row i's request (a sampled one must
        carry a seed: the engine gives unseeded requests a random one at admission);
        output_indices[i]: the output position row i produces (0 = first output token);
        choice_indices[i]: which of the request's choices row i belongs to (default 0; ``n > 1``
        gives each choice its own stream); history[i]: row i's (prompt, output so far) token ids,
        needed where a row uses a penalty or min_tokens (:mod:`engine.logits_processors`);
        grammar: the structured-output masks of the constrained rows (None = none).
        Raises ValueError for a sampled row without a seed, or a processed row without history.
        """
        raw = logits
        if any(sp.processed for sp in params):
            if history is None:
                raise ValueError("penalties and min_tokens need each row's tokens so far (history)")
            logits = process_logits(logits, params, history, self.eos_token_ids)
        if grammar is not None:
            logits = apply_grammar(logits, grammar, raw)
        greedy = torch.argmax(logits, dim=-1)
        rows = _rows(params, output_indices, choice_indices or [0] * len(params), logits.shape[-1])
        if not rows.index:
            return greedy
        sampled = _sample_rows(logits, rows)
        if len(rows.index) == len(params):
            return sampled
        return greedy.index_copy(0, torch.tensor(rows.index, device=logits.device), sampled)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int], choice_indices: list[int] | None = None,
               history: list[History] | None = None, grammar: GrammarRows | None = None) -> list[int]:
        """:meth:`sample_ids` as a list: the step's one device-to-host transfer."""
        return self.sample_ids(logits, params, output_indices, choice_indices, history, grammar).tolist()
