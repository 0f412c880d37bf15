"""The router's self-check: per pool, the prefix-cache hit tokens predicted next to those reported.

At each pick the orchestrator predicts how many prompt tokens the chosen server's prefix cache will
serve: the blocks of the prompt's longest prefix its KV index holds
(:meth:`orchestrator.kv_index.KVIndexes.matched_blocks`), capped as the engine caps a hit
(``(num_tokens - 1) // block_size`` blocks: the last prompt token is always computed), times
``block_size``. When the server answers, its reported hit
(``usage.prompt_tokens_details.cached_tokens``, or ``disaggregated_params.cached_tokens`` of a ctx
answer) is added beside it. Predicted far above reported means the index is wrong; reported far
above predicted, or many ``unindexed`` picks, means the router is routing blind (load-only): the
silent fallback this check exists to show. Concurrent requests that share a prefix nobody holds
yet also read reported > predicted (at pick time the blocks did not exist; the first one to finish
its prefill caches them for the rest): read the gap on traffic that arrives over time, not on a
burst. In ``/metrics`` (counters, tokens) and in ``/cluster/status`` / ``pdserve status``.

Counted: every ctx-pool answer, and gen-pool answers where the gen server computed the prompt
itself (colocated: conditional disaggregation) and answered with a JSON body. Not counted: a
``generation_only`` request (its ``cached_tokens`` is the ctx server's hit; the blocks its partial
pull skipped on the gen server are counted only in that server's ``kv_blocks_skipped``, not per
answer, so the gen pool's routing of disaggregated requests is not self-checked), and a colocated
stream (the relay does not parse its usage).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from .kv_index import KVIndexes
from .loop_metrics import LoopCounter  # per answer: lock-free (orchestrator.loop_metrics)
from .router import RouteHint


@dataclass
class PoolHits:
    """Totals of one pool (tokens)."""

    requests: int = 0
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    reported_hit_tokens: int = 0
    unindexed: int = 0  # picks of a server with no synced index (no prediction possible: counted 0)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class HitSelfCheck:
    """Predictions at pick time, reports at answer time (see the module docstring)."""

    def __init__(self, indexes: KVIndexes, block_size: int, registry: CollectorRegistry) -> None:
        self.indexes = indexes
        self.block_size = block_size
        self.pools = {"ctx": PoolHits(), "gen": PoolHits()}
        self._predicted = LoopCounter("pdserve_orchestrator_kv_predicted_hit_tokens",
                                  "Prompt tokens the router predicted the chosen server's prefix cache holds",
                                  ["pool"], registry=registry)
        self._reported = LoopCounter("pdserve_orchestrator_kv_reported_hit_tokens",
                                 "Prompt tokens the servers reported from their prefix cache (cached_tokens)",
                                 ["pool"], registry=registry)
        self._prompt = LoopCounter("pdserve_orchestrator_kv_checked_prompt_tokens",
                               "Prompt tokens of the requests in the predicted/reported self-check", ["pool"],
                               registry=registry)
        self._unindexed = LoopCounter("pdserve_orchestrator_kv_unindexed_picks",
                                  "Self-checked picks of a server without a synced KV index (load-only)",
                                  ["pool"], registry=registry)
        # Per pool, once: labels() validates and locks on every call, and record() runs per answer.
        self._children = {pool: tuple(c.labels(pool=pool) for c in (self._prompt, self._reported, self._predicted,
                                                                      self._unindexed)) for pool in self.pools}

    def synced(self, url: str) -> bool:
        """Whether ``url`` has a synced KV index (a prediction there is a number, not None)."""
        index = self.indexes.find(url)
        return index is not None and index.synced

    def predict(self, url: str, hint: RouteHint | None) -> int | None:
        """Hit tokens predicted on ``url`` for ``hint``; None: no synced index (or no token ids)."""
        if hint is None or hint.num_tokens <= 0:
            return None
        matched = self.indexes.matched_blocks(url, hint.block_hashes)
        if matched is None:
            return None
        return min(matched, (hint.num_tokens - 1) // self.block_size) * self.block_size

    def record(self, pool: str, hint: RouteHint | None, predicted: int | None, reported: int | None,
               prompt_tokens: int | None = None) -> None:
        """Count one answered request of ``pool`` (skipped without a prompt length or a reported hit).
        ``prompt_tokens``: the prompt's length when the hint's is not computed (a pending hint: the
        server's ``usage.prompt_tokens``); None: ``hint.num_tokens``."""
        if hint is None or reported is None:
            return
        num_tokens = hint.num_tokens if prompt_tokens is None else prompt_tokens
        if num_tokens <= 0:
            return
        hits = self.pools[pool]
        hits.requests += 1
        hits.prompt_tokens += num_tokens
        hits.reported_hit_tokens += reported
        hits.predicted_hit_tokens += predicted or 0
        prompt, reported_c, predicted_c, unindexed = self._children[pool]
        prompt.inc(num_tokens)
        reported_c.inc(reported)
        predicted_c.inc(predicted or 0)
        if predicted is None:
            hits.unindexed += 1
            unindexed.inc()


def reported_hit(answer: object) -> int | None:
    """``cached_tokens`` of an OpenAI answer (usage) or of a ctx answer's ``disaggregated_params``."""
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        params = choices[0].get("disaggregated_params")
        if isinstance(params, dict) and isinstance(params.get("cached_tokens"), int):
            return params["cached_tokens"]
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
