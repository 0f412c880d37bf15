"""Turn a scheduled batch into an execution plan, run the model on it and sample."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.attention_meta import build_metadata
from engine.cpu_ops import KernelOps
from engine.decode_inputs import decode_inputs, is_pure_decode
from engine.grammar_mask import grammar_rows
from engine.logprob_math import token_logprobs
from engine.logprobs import TokenLogprob
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.sequence import Sequence


@dataclass
class PlanItem:
    """One sequence's share of a step: tokens [num_computed, num_computed + num_new)."""

    num_computed: int
    num_new: int
    block_ids: list[int]


@dataclass
class ExecPlan:
    """What one forward needs, as plain picklable data (TP rank 0 broadcasts it).

    items: decodes (num_new == 1) first, then prefill chunks; input_ids: their new tokens
    concatenated in that order; sample_rows: rows of input_ids whose logits are sampled;
    prompt_rows: rows whose logits give prompt logprobs (after the sample rows in the logits).
    """

    input_ids: list[int]
    items: list[PlanItem]
    sample_rows: list[int]
    prompt_rows: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies of forks (TP followers)


@dataclass
class ModelInputs:
    """One forward's tensors (ModelRunner.inputs): ids, positions [T] int64; rows [S] int64 (logit
    rows: sample rows, then prompt rows); metas: attention metadata per window; max_position: the
    largest position (no device read needed)."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    metas: dict[int | None, AttentionMetadata]
    max_position: int


Picks = dict[tuple[str, int], list[tuple[int, "TokenLogprob | None"]]]


@dataclass
class PromptSpan:
    """Prompt logprobs one step computes for ``seq``: positions [start, start + count), each
    predicting the prompt token after it."""

    seq: Sequence
    start: int
    count: int


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A host tensor on ``device`` (an asynchronous host-to-device copy; None stays None)."""
    return None if t is None else t.to(device, non_blocking=True)


def _meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """Every index and mask tensor of ``meta`` on ``device``."""
    prefills = [dataclasses.replace(p, block_ids=_to(p.block_ids, device), mask=_to(p.mask, device))
                for p in meta.prefills]
    return dataclasses.replace(meta, slot_blocks=_to(meta.slot_blocks, device),
                               slot_offsets=_to(meta.slot_offsets, device),
                               decode_tables=_to(meta.decode_tables, device),
                               decode_mask=_to(meta.decode_mask, device), prefills=prefills,
                               decode_rows=_to(meta.decode_rows, device))


def _ordered(items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """Single-token items (decodes) first: attention batches them; chunks follow."""
    return [it for it in items if it[1] == 1] + [it for it in items if it[1] != 1]


def _plain_greedy(seq: Sequence) -> bool:
    """Whether seq's row is one greedy argmax of its raw logits: temperature 0, no logits processor,
    grammar or logprobs, and not about to fork (a fork samples its row n times)."""
    sp = seq.sampling
    return (sp.greedy and not sp.processed and sp.logprobs is None and seq.grammar is None
            and not (seq.n > 1 and seq.num_output_tokens == 0))


class ModelRunner:
    """Executes one step for the scheduled (sequence, num_new_tokens) items."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler, device: str = "cpu"):
        """device: where model, kv_cache and the step's tensors live ("cpu" | "cuda:N"). The plan's
        indices are built on the host and copied over once per step (no device-to-host read)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = torch.device(device)
        self.inputs_s = 0.0  # cumulative seconds forward() spent in inputs()
        # The CPU kernels read each decode row's block table and key range themselves: the gather
        # path's decode_rows and decode_mask would be built for nothing.
        self.kernels = isinstance(getattr(model, "ops", None), KernelOps)
        self.fast_decode_inputs = True  # pure-decode steps: engine.decode_inputs (same tensors, one list)
        self.fast_greedy = True  # steps whose rows are all plain greedy: one argmax, one host read

    def execute(self, items: list[tuple[Sequence, int]]) -> dict[str, int]:
        """Compute KV for the new tokens; return request_id -> sampled token for every sequence
        whose tokens are now all computed (decodes and final prefill chunks)."""
        plan, seqs, spans = self.plan(items)
        logits = self.forward(plan)
        self.record_prompt_logprobs(spans, logits[len(seqs):])
        return self.sample(seqs, logits[:len(seqs)])

    def plan(self, items: list[tuple[Sequence, int]]
             ) -> tuple[ExecPlan, list[Sequence], list[PromptSpan]]:
        """The plan of this step, the sequences its sample rows belong to (in row order) and the
        prompt-logprob spans of its prompt rows (in row order)."""
        input_ids, plan_items, rows, seqs, prompt_rows, spans = [], [], [], [], [], []
        for seq, k in _ordered(items):
            c = seq.num_computed
            if seq.wants_prompt_logprobs:  # positions i predict prompt token i + 1
                start = max(c, len(seq.prompt_logprobs) - 1)
                stop = min(c + k, seq.num_prompt_tokens - 1)
                if stop > start:
                    base = len(input_ids) - c
                    prompt_rows += range(base + start, base + stop)
                    spans.append(PromptSpan(seq, start, stop - start))
            input_ids += seq.token_ids[c:c + k]
            plan_items.append(PlanItem(c, k, seq.block_ids[:-(-(c + k) // self.block_size)]))
            if c + k == seq.num_tokens:
                rows.append(len(input_ids) - 1)
                seqs.append(seq)
        return ExecPlan(input_ids, plan_items, rows, prompt_rows), seqs, spans

    def inputs(self, plan: ExecPlan) -> ModelInputs:
        """The tensors of ``plan`` on this runner's device: token ids, positions, logit rows and the
        attention metadata of every window (host work: the step's Python-side cost). A pure-decode
        plan takes engine.decode_inputs (the same tensors from one host list)."""
        num_layers = None if self.kernels else self.kv_cache.shape[1]
        windows = tuple(dict.fromkeys(self.model.windows))  # distinct attention windows, in layer order
        if self.fast_decode_inputs and plan.items and is_pure_decode(plan.items):
            ids, pos, rows, metas, max_pos = decode_inputs(
                plan.items, plan.input_ids, plan.sample_rows + plan.prompt_rows, self.block_size,
                windows, num_layers, with_mask=not self.kernels)
        else:
            pos = torch.cat([torch.arange(it.num_computed, it.num_computed + it.num_new)
                             for it in plan.items])
            rows = torch.tensor(plan.sample_rows + plan.prompt_rows, dtype=torch.long)
            metas = {w: build_metadata(plan.items, pos, self.block_size, w, num_layers)
                     for w in windows}   # full attention and/or each window
            max_pos = max(it.num_computed + it.num_new for it in plan.items) - 1
            ids = torch.tensor(plan.input_ids, dtype=torch.long)
        if self.device.type != "cpu":
            ids, pos, rows = _to(ids, self.device), _to(pos, self.device), _to(rows, self.device)
            metas = {w: _meta_to(m, self.device) for w, m in metas.items()}
        return ModelInputs(ids, pos, rows, metas, max_pos)

    def run(self, inputs: ModelInputs, compute_logits: bool = True) -> torch.Tensor | None:
        """Run the model on prepared inputs (writes the KV); see :meth:`forward`."""
        return self.model.forward(inputs.ids, inputs.positions, inputs.rows, self.kv_cache, inputs.metas,
                                  compute_logits=compute_logits, max_position=inputs.max_position)

    def forward(self, plan: ExecPlan, compute_logits: bool = True) -> torch.Tensor | None:
        """Run the model on plan (writes the KV); float32 logits [len(sample_rows) +
        len(prompt_rows), vocab]: the sample rows first. Adds the seconds spent building the
        inputs (:meth:`inputs`) to ``inputs_s`` (the engine's step clock charges them to the plan)."""
        t0 = time.perf_counter()
        inputs = self.inputs(plan)
        self.inputs_s += time.perf_counter() - t0
        return self.run(inputs, compute_logits)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> dict[str, int]:
        """request_id -> sampled token (choice 0's first) of each sequence (logits: its rows, in seqs order)."""
        return {rid: picks[0][0] for (rid, index), picks in self.sample_with_logprobs(seqs, logits).items()
                if index == 0}

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the KV of block src into block dst (every layer, K and V) for each (src, dst)."""
        for src, dst in copies:
            self.kv_cache[dst].copy_(self.kv_cache[src])

    def sample_with_logprobs(self, seqs: list[Sequence], logits: torch.Tensor) -> Picks:
        """(request_id, choice index) -> [(sampled token, its logprob entry when sampling.logprobs is
        set)]: one pick per sequence, or n for a sequence about to fork (``n`` > 1, no output yet:
        its one row is sampled with choice indices 0..n-1, engine.choices)."""
        if not seqs:
            return {}
        if self.fast_greedy and all(_plain_greedy(s) for s in seqs):  # what the general path computes
            if self.kernels and logits.dtype == torch.float32:  # torch.argmax's answer, one pass per row
                ids = torch.ops.pdserve_cpu.argmax_rows(logits).tolist()
            else:
                ids = torch.argmax(logits, dim=-1).tolist()
            return {(s.request_id, s.index): [(t, None)] for s, t in zip(seqs, ids)}
        owners, choices = [], []
        for s in seqs:
            m = s.n if s.n > 1 and s.num_output_tokens == 0 else 1
            owners += [s] * m
            choices += list(range(m)) if m > 1 else [s.index]
        if len(owners) != len(seqs):
            rows = [r for r, s in enumerate(seqs) for _ in range(s.n if s.n > 1 and s.num_output_tokens == 0 else 1)]
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        picks: Picks = {}
        for s, t, lp in zip(owners, *self._sample_rows(owners, choices, logits)):
            picks.setdefault((s.request_id, s.index), []).append((t, lp))
        return picks

    def _sample_rows(self, seqs: list[Sequence], choices: list[int], logits: torch.Tensor
                     ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row (row i: seqs[i], drawing as choice choices[i]) and its logprob entry."""
        params = [s.sampling for s in seqs]
        history = None
        if any(sp.processed for sp in params):
            history = [(s.token_ids[:s.num_prompt_tokens] if s.sampling.repetition_penalty != 1.0 else [],
                        s.output_token_ids if s.sampling.processed else []) for s in seqs]
        # n > 1: a sequence about to fork has n rows here, all under its one grammar state (no token yet)
        grammar = grammar_rows([s.grammar for s in seqs], logits.shape[-1], logits.device)
        ids = self.sampler.sample_ids(logits, params, [s.num_output_tokens for s in seqs], choices, history, grammar)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=logits.device)
            entries = token_logprobs(logits.index_select(0, idx), ids.index_select(0, idx),
                                     [params[i].logprobs for i in want])
            for i, entry in zip(want, entries):
                logprobs[i] = entry
        return ids.tolist(), logprobs

    def record_prompt_logprobs(self, spans: list[PromptSpan], logits: torch.Tensor) -> None:
        """Append each span's prompt logprobs to its sequence; logits: the prompt rows, in order."""
        if not spans:
            return
        targets, ks = [], []
        for sp in spans:
            targets += sp.seq.token_ids[sp.start + 1:sp.start + 1 + sp.count]
            ks += [sp.seq.sampling.prompt_logprobs] * sp.count
        entries = token_logprobs(logits, torch.tensor(targets, device=logits.device), ks)
        at = 0
        for sp in spans:
            sp.seq.prompt_logprobs.extend(entries[at:at + sp.count])
            at += sp.count

