"""CPU linear layers on oneDNN with weights reordered ("prepacked") once at load.

A decode step on a CPU is mostly matrix-vector products over weights that do not fit in cache
(SmolLM2: 121 products, 540 MB in fp32, 78% of a batch-1 step with ``F.linear``). ``F.linear``
hands fp32 to MKL's sgemm and bf16 to oneDNN, both on the plain ``[N, K]`` weight, so every call
re-reads the weight in a layout the kernel must stride through. oneDNN's linear on a weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the same
call torch.compile's CPU freezing pass uses) streams it instead. Measured on the 2-core EPYC CI
machine, 30 SmolLM2 layers + lm_head per step, 2 threads (``bench/cpu_linear.py``):

=========  ====  ========  ======  ====
dtype      rows  F.linear  packed  hint
=========  ====  ========  ======  ====
float32    1     56.3 ms   39.5 ms    1
float32    8     62.6 ms   54.0 ms    1
bfloat16   1     30.6 ms   21.8 ms    8
bfloat16   8     34.4 ms   20.0 ms    8
=========  ====  ========  ======  ====

(two runs, load average 0.9 and 1.5; the hint is pack_weight's batch_hint. fp32 now packs with
hint 8: see pack_weight.)
bf16 results are bit-identical to ``F.linear`` (which already runs oneDNN for bf16); fp32 ones
differ in rounding only (oneDNN's fp32 kernel accumulates in another order: max abs error vs an
fp64 reference 1e-4 against F.linear's 6e-5 for K = 576). The packed tensor is an opaque oneDNN
tensor (``is_mkldnn``): it has a shape but cannot be indexed, sliced or moved; keep the dense
weight where anything else reads it (the tied embedding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.gemv_layout import gemv_panel_arena

_PACKABLE = (torch.float32, torch.bfloat16)
DEFAULT_BATCH_HINT = {torch.float32: 8, torch.bfloat16: 8}  # see pack_weight


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN and its linear ops for ``dtype`` on this CPU (probed
    once per dtype on a 2x2 weight). oneDNN's bf16 reorder needs AVX-512 (bw, vl, dq) or
    AVX-NE-CONVERT: on an AVX2-only CPU bf16 weights stay plain (F.linear)."""
    if not torch.backends.mkldnn.is_available() or dtype not in _PACKABLE:
        return False
    try:
        w = torch.ones(2, 2, dtype=dtype)
        out = packed_linear(torch.ones(1, 2, dtype=dtype), torch.ops.mkldnn._reorder_linear_weight(w, 1), None)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0, dtype=dtype)))


def pack_weight(weight: torch.Tensor, batch_hint: int | None = None) -> torch.Tensor:
    """The oneDNN-reordered copy of a CPU linear weight [N, K] (float32 or bfloat16).

    batch_hint: the row count the layout is tuned for (any row count works afterwards); None =
    the dtype's default (DEFAULT_BATCH_HINT), 8 for both dtypes. In bf16 a hint of 8 is as fast as
    any other at 1 to 512 rows, while 1 picks a layout 1.3x slower at 1 row and 2x at 8 (30
    SmolLM2 layers + lm_head). In fp32 (torch 2.13's oneDNN, AMD EPYC with AVX-512, 2 threads,
    spinning OpenMP threads; ``bench/cpu_linear.py --hints 1 8``, docs/benchmarks.md issue 11) the 121 products of
    one step take 11-12 ms at 1 row and 14.5-15 ms at 8 rows on the hint-8 layout against
    15.5-16.5 and 24.7-25.4 ms on the hint-1 layout. At 2 rows and more both layouts run the same
    blocked kernel and give the same bits; at 1 row the hint-1 layout takes a GEMV kernel that
    rounds differently (both within 3.5e-6 of fp64 for K = 576). SmolLM2's greedy tokens equal
    HF transformers' with either (12 prompts x 48 tokens, alone and batched, also with
    ONEDNN_MAX_CPU_ISA=AVX2); an older build parted from HF on one oracle prompt with hint 8,
    which tests/engine/test_model_vs_hf.py would catch.
    Returns the weight unchanged when it cannot be packed (not on the CPU, another dtype, or no
    oneDNN linear for its dtype on this CPU: see packing_available).
    """
    if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE or weight.dim() != 2
            or not packing_available(weight.dtype)):
        return weight
    hint = DEFAULT_BATCH_HINT[weight.dtype] if batch_hint is None else batch_hint
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), hint)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] (dense, the weight's dtype) @ packed weight [N, K]^T (+ bias [N]) -> [T, N]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@dataclass(frozen=True)
class DualWeight:
    """A CPU linear weight [N, K] in two layouts: oneDNN-packed (pack_weight; the plain weight where
    oneDNN cannot pack its dtype on this CPU, e.g. bf16 without AVX-512) for products of 2+ rows,
    and the GEMV kernel's 4-row panels (engine.gemv_layout) for one-row products on
    ``torch.ops.pdserve_cpu.gemv`` (engine.cpu_ops), which streams them at close to the memory
    bandwidth where oneDNN's one-row kernel reached ~85% of it (docs/benchmarks.md, issue 11).
    Costs one more copy of the weight (a tied lm_head too: the embedding stays row-major)."""

    packed: torch.Tensor
    panels: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.panels.shape


def pack_decoder_linears(model, keep_panels: bool = False) -> None:
    """Pack a decoder's linear weights in place: every layer's ``qkv``, ``o_proj``, ``gate_up``,
    ``down`` and the model's ``lm_head`` (the shape engine.model_weights builds; the row-major
    embedding stays where a tied head shared it). keep_panels: each becomes a DualWeight whose
    panels share one arena on huge pages (engine.gemv_layout.gemv_panel_arena; the GEMV kernel
    must be loaded: engine.cpu_ops.load_library)."""
    names = [(w, name) for w in model.layers for name in ("qkv", "o_proj", "gate_up", "down")]
    names.append((model, "lm_head"))
    weights = [getattr(owner, name) for owner, name in names]
    packed = [pack_weight(w) for w in weights]
    if not keep_panels:
        for (owner, name), p in zip(names, packed):
            setattr(owner, name, p)
        return
    panels = gemv_panel_arena([w.contiguous() for w in weights])
    for (owner, name), p, g in zip(names, packed, panels):
        setattr(owner, name, DualWeight(p, g))
