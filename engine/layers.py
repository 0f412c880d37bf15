"""Stateless Llama building blocks (match HF transformers numerics)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cpu_linear import DualWeight, packed_linear
from engine.rope import LinearScaling, RopeScaling, inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like HF. x: [T, H] -> [T, H] (x.dtype).

    F.rms_norm is one fused op on CPU (the hand-written form was six); in float32 it gives the
    same bits as HF's `weight * (x * rsqrt(mean(x^2) + eps))`, and other dtypes keep HF's order
    (normalize in float32, cast, then scale).
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x [..., H] -> [..., H] (x.dtype), normalized and scaled in float32 and cast
    last (HF's Gemma3RMSNorm: `(x * rsqrt(mean(x^2) + eps)) * (1 + w)`, then `.type_as(x)`).

    scale: float32 [H], the checkpoint's w already offset: `1 + w` (engine.gemma3 stores it so).
    """
    return F.rms_norm(x.float(), x.shape[-1:], scale, eps).to(x.dtype)


class RotaryTable:
    """RoPE cos and sign-folded sin tables [P, head_dim] for positions 0..P-1, built once and
    grown (doubling) when a step needs a later position, instead of recomputed every step.

    Values equal HF's: inv_freq = 1 / theta^(2i / head_dim) in float32 (rescaled by `scaling`,
    engine.rope), angle = position * inv_freq, cos/sin duplicated over both halves, cast to
    dtype. The sin table's first half is negated so that apply_rope needs one roll instead of
    HF's rotate_half (slice, neg, cat).
    """

    def __init__(self, head_dim: int, theta: float, dtype: torch.dtype, size: int = 4096,
                 scaling: RopeScaling | LinearScaling | None = None):
        self.head_dim, self.theta, self.dtype, self.scaling = head_dim, theta, dtype, scaling
        self.cos = self.sin = torch.empty(0)
        self._size = size

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 (all <= max_position) -> (cos, signed sin), each [T, head_dim]."""
        cos, sin = self.tables(max_position, positions.device)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables(self, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, signed sin) tables [P, head_dim] on device, grown to P > max_position."""
        if max_position >= self.cos.shape[0] or self.cos.device != device:
            while self._size <= max_position:
                self._size *= 2
            self._build(self._size, device)
        return self.cos, self.sin

    def _build(self, size: int, device: torch.device) -> None:
        hd = self.head_dim
        freq = inv_freq(hd, self.theta, self.scaling, device)
        freqs = torch.arange(size, device=device).float()[:, None] * freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :hd // 2] = -sin[:, :hd // 2]
        self.cos, self.sin = emb.cos().to(self.dtype), sin.to(self.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, head_dim] with RotaryTable rows [T, head_dim] (HF rotate_half layout:
    x*cos + rotate_half(x)*sin, where rotate_half(x) * sin == roll(x, half) * signed_sin)."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rolled * signed_sin[:, None, :]


SKINNY_MAX_ROWS = 16
SKINNY_MIN_OUT = 2048


def linear(x: torch.Tensor, weight: torch.Tensor | DualWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N].

    A float32 CPU product with 2..16 rows and N >= 2048 outputs runs as (weight @ x^T)^T: MKL's
    sgemm on the transposed-weight form of such a skinny product took 1.5-3x the CPU time
    (lm_head [49152, 576] at 8 rows: 36 vs 15 ms; gate_up [3072, 576]: 41 vs 29 ms per 30
    layers; measured with process_time on the 2-core CI machine). One row is a GEMV either way.
    A weight packed by engine.cpu_linear.pack_weight runs on oneDNN's linear instead; a
    DualWeight (engine.cpu_kernels) runs one-row products on pdserve's GEMV kernel and more rows
    on its packed form.
    """
    if isinstance(weight, DualWeight):
        if x.shape[0] == 1:
            return torch.ops.pdserve_cpu.gemv(x, weight.panels, bias)
        weight = weight.packed
    if weight.is_mkldnn:  # reordered once at load (engine.cpu_linear)
        return packed_linear(x, weight, bias)
    t, n = x.shape[0], weight.shape[0]
    if (1 < t <= SKINNY_MAX_ROWS and n >= SKINNY_MIN_OUT and x.dtype == torch.float32
            and x.device.type == "cpu"):
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2*I] (gate then up) -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2*I] (gate then up) -> gelu_tanh(gate) * up: [T, I] (Gemma's MLP; HF's
    `gelu_pytorch_tanh` is torch's tanh-approximated GELU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap, elementwise in x.dtype (Gemma's logit soft-capping; HF's order)."""
    return torch.tanh(x / cap) * cap
