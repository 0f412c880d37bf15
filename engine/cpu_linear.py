"""CPU linear layers on oneDNN with weights reordered ("prepacked") once at load.

A decode step on a CPU is mostly matrix-vector products over weights that do not fit in cache
(SmolLM2: 121 products, 540 MB in fp32, 78% of a batch-1 step with ``F.linear``). ``F.linear``
hands fp32 to MKL's sgemm and bf16 to oneDNN, both on the plain ``[N, K]`` weight, so every call
re-reads the weight in a layout the kernel must stride through. oneDNN's linear on a weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the same
call torch.compile's CPU freezing pass uses) streams it instead. Measured on the 2-core EPYC CI
machine, 30 SmolLM2 layers + lm_head per step, 2 threads (``bench/cpu_linear.py``):

=========  ====  ========  ======
dtype      rows  F.linear  packed
=========  ====  ========  ======
float32    1     56.3 ms   39.5 ms
float32    8     62.6 ms   54.0 ms
bfloat16   1     27.9 ms   22.3 ms
bfloat16   8     40.5 ms   29.2 ms
=========  ====  ========  ======

(load average ~1; in a whole engine step, ``bench/engine_step.py``, the gain is 10-25%.)
bf16 results are bit-identical to ``F.linear`` (which already runs oneDNN for bf16); fp32 ones
differ in rounding only (oneDNN's fp32 kernel accumulates in another order: max abs error vs an
fp64 reference 1e-4 against F.linear's 6e-5 for K = 576). The packed tensor is an opaque oneDNN
tensor (``is_mkldnn``): it has a shape but cannot be indexed, sliced or moved; keep the dense
weight where anything else reads it (the tied embedding).
"""
from __future__ import annotations

import functools

import torch

_PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def packing_available() -> bool:
    """True when this torch build has oneDNN and its linear ops (probed once on a 2x2 weight)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(2, 2)
        out = packed_linear(torch.ones(1, 2), torch.ops.mkldnn._reorder_linear_weight(w, 1), None)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


def pack_weight(weight: torch.Tensor, batch_hint: int = 1) -> torch.Tensor:
    """The oneDNN-reordered copy of a CPU linear weight [N, K] (float32 or bfloat16).

    batch_hint: the row count the layout is tuned for (any row count works afterwards).
    Returns the weight unchanged when it cannot be packed (not on the CPU, another dtype, or no
    oneDNN in this torch build: see packing_available).
    """
    if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE or weight.dim() != 2
            or not packing_available()):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] (dense, the weight's dtype) @ packed weight [N, K]^T (+ bias [N]) -> [T, N]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
