"""Layer building blocks against the formulas HF transformers uses (bit-exact in float32)."""
import torch

from engine.layers import RotaryTable, apply_rope, linear, rms_norm


def hf_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def hf_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def test_rotary_table_grows_and_equals_hf():
    table = RotaryTable(head_dim=16, theta=10000.0, dtype=torch.float32, size=8)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    for positions in (torch.tensor([0, 1, 2, 3, 7]), torch.tensor([5, 8, 100, 1000, 4097])):
        cos, sin = table.lookup(positions, int(positions.max()))
        want = hf_rope(x, *hf_cos_sin(positions, 16, 10000.0))
        assert torch.equal(apply_rope(x, cos, sin), want)
    assert table.cos.shape[0] == 8192   # doubled from 8 until 4097 fit


def test_rms_norm_equals_hf_in_float32():
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(64, generator=torch.Generator().manual_seed(2))
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(rms_norm(x, w, 1e-5), w * xf, rtol=0, atol=1e-6)


def test_skinny_linear_equals_f_linear():
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(4096, 64, generator=gen), torch.randn(4096, generator=gen)
    for rows in (1, 2, 8, 16, 17):
        x = torch.randn(rows, 64, generator=gen)
        out = linear(x, w, b)
        assert out.is_contiguous() and out.shape == (rows, 4096)
        assert torch.allclose(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
