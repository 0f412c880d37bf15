"""Log-probabilities of chosen tokens and their top alternatives, batched (one host transfer).

The rank-side half of :mod:`engine.logprobs` (torch), apart so that the frontends, which only
carry :class:`~engine.logprobs.TokenLogprob` records, never import torch.
"""
from __future__ import annotations

import torch

from engine.logprobs import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """logits [R, V] float32 (any device), token_ids [R] int64: row r's token; ks[r] >= 0 top
    alternatives for row r. Returns R :class:`TokenLogprob` (an empty list for R == 0)."""
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    kmax = max(ks)
    top_v: list[list[float]] = [[] for _ in ks]
    top_i: list[list[int]] = [[] for _ in ks]
    if kmax > 0:
        values, ids = torch.topk(lp, kmax, dim=-1, sorted=True)
        top_v, top_i = values.tolist(), ids.tolist()
    ids_host = token_ids.tolist()
    return [TokenLogprob(ids_host[r], chosen[r], tuple(zip(top_i[r][:k], top_v[r][:k])))
            for r, k in enumerate(ks)]
