"""Logits processors, batched over the rows of one step: logit_bias, min_tokens, penalties.

Semantics as in the OpenAI API and vLLM (``vllm/v1/sample``): on the raw float32 logits, in this
order, before greedy argmax or temperature:

1. ``logit_bias``: ``logits[v] += bias[v]``.
2. ``min_tokens``: while a row has fewer output tokens, its EOS and ``stop_token_ids`` are -inf.
3. ``repetition_penalty`` r (Keskar et al., "CTRL", 2019; HF's ``RepetitionPenaltyLogitsProcessor``):
   for every token of the prompt or output so far, ``l / r`` if ``l > 0`` else ``l * r``.
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's documented formula):
   ``l -= f * count(v in output) + p * (count > 0)``.

Each is one tensor op over the rows that use it (index_put / scatter); Python touches only the
requests' own token lists and bias entries, never the vocabulary.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

History = tuple[list[int], list[int]]  # (prompt token ids, output token ids so far) of one row


def process_logits(logits: torch.Tensor, params: list[SamplingParams], history: list[History],
                   eos_token_ids: list[int]) -> torch.Tensor:
    """logits [S, V] float32 -> processed logits [S, V] (the input itself when no row uses any
    processor, else a new tensor; the input is never written). history[i]: row i's tokens."""
    rows = [i for i, sp in enumerate(params) if sp.processed]
    if not rows:
        return logits
    out = logits.clone()
    _logit_bias(out, params, rows)
    _min_tokens(out, params, rows, history, eos_token_ids)
    penalized = [i for i in rows if params[i].penalized]
    if penalized:
        _penalties(out, params, penalized, history)
    return out


def _logit_bias(out: torch.Tensor, params: list[SamplingParams], rows: list[int]) -> None:
    r, c, v = [], [], []
    for i in rows:
        for token, bias in (params[i].logit_bias or {}).items():
            r.append(i)
            c.append(token)
            v.append(bias)
    if r:
        dev = out.device
        out.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                       torch.tensor(v, device=dev, dtype=out.dtype), accumulate=True)


def _min_tokens(out: torch.Tensor, params: list[SamplingParams], rows: list[int], history: list[History],
                eos_token_ids: list[int]) -> None:
    r, c = [], []
    vocab = out.shape[-1]
    for i in rows:
        sp = params[i]
        if len(history[i][1]) >= sp.min_tokens:
            continue
        banned = {t for t in sp.stop_token_ids if t < vocab} | (set() if sp.ignore_eos else set(eos_token_ids))
        r += [i] * len(banned)
        c += sorted(banned)
    if r:
        dev = out.device
        out.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                       torch.tensor(float("-inf"), device=dev, dtype=out.dtype))


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(lists), max(len)] int64, each list padded with ``pad`` (at least one column)."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device)


def _penalties(out: torch.Tensor, params: list[SamplingParams], rows: list[int], history: list[History]) -> None:
    """In place on ``out``'s penalized rows. In-place ops throughout: on a CPU each fresh [B, V]
    temporary cost more (allocation, page faults) than the arithmetic."""
    dev, vocab, dt = out.device, out.shape[-1], out.dtype
    whole = len(rows) == out.shape[0]
    idx = None if whole else torch.tensor(rows, device=dev)
    sub = out if whole else out.index_select(0, idx)
    outputs = _padded([history[i][1] for i in rows], vocab, dev)  # pad id V lands in a dropped column
    counts = torch.zeros(len(rows), vocab + 1, device=dev, dtype=dt)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=dt))
    counts = counts[:, :vocab]
    present = torch.gt(counts, 0).to(dt)
    if any(params[i].repetition_penalty != 1.0 for i in rows):
        # seen token: times 1/r when positive, times r otherwise, as one multiplier per element.
        rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev, dtype=dt)[:, None]
        seen = torch.zeros(len(rows), vocab + 1, device=dev, dtype=dt)
        seen.scatter_(1, _padded([history[i][0] for i in rows], vocab, dev), 1.0)
        seen = torch.maximum(seen[:, :vocab], present)
        scale = torch.gt(sub, 0).to(dt).mul_(1.0 / rep - rep).add_(rep).sub_(1.0)  # 1/r - 1 or r - 1
        sub.mul_(scale.mul_(seen).add_(1.0))
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev, dtype=dt)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev, dtype=dt)[:, None]
    sub.sub_(counts.mul_(freq)).sub_(present.mul_(pres))
    if not whole:
        out.index_copy_(0, idx, sub)
