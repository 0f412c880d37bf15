"""Micro-benchmark (issue 11): decode attention of SmolLM2's 30 layers (gather K/V blocks + SDPA)
with and without the head-major copy of the gathered blocks, alternating in one process.

    .venv/bin/python bench/attention_gather.py BATCH [DTYPE]      # e.g. 8 bfloat16; 1 float32

The cache has SmolLM2's block-major shape ([512 blocks, 30 layers, K/V, 16, 3 heads, 64]); each of
BATCH rows reads 192 tokens (12 consecutive blocks). ``copy=True`` is the old ``_gather``
(index_select, then ``.contiguous()`` of the [kv_heads, S, head_dim] view), ``copy=False`` the
current one (SDPA reads the strided view). Asserts both give the same bits, then prints wall and
CPU time (``process_time``: steadier than wall on a loaded machine) of 30 rounds of each, min and
median.
"""
import os, sys, time, statistics
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch, torch.nn.functional as F
torch.set_num_threads(2)
dt = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
N, L, bs, kvh, hd, heads = 512, 30, 16, 3, 64, 9
cache = torch.randn(N, L, 2, bs, kvh, hd).to(dt)
D, ctx = int(sys.argv[1]), 192
nb = -(-ctx // bs)
tables = torch.arange(D * nb).view(D, nb) + 7   # consecutive blocks, as the allocator hands them out
q = torch.randn(D, heads, hd).to(dt)
def gather(c, ids, n, contiguous):
    x = c.index_select(0, ids.flatten()).view(*ids.shape, *c.shape[1:]).flatten(-4, -3)[..., :n, :, :].transpose(-3, -2)
    return x.contiguous() if contiguous else x
def step(contiguous):
    outs = []
    for i in range(L):
        k = gather(cache[:, i, 0], tables, ctx, contiguous); v = gather(cache[:, i, 1], tables, ctx, contiguous)
        outs.append(F.scaled_dot_product_attention(q.view(D, kvh, heads // kvh, hd), k, v))
    return outs
assert all(torch.equal(a, b) for a, b in zip(step(True), step(False)))
res = {True: ([], []), False: ([], [])}
for r in range(30):
    for c in (True, False):
        t0, c0 = time.perf_counter(), time.process_time()
        step(c)
        res[c][0].append((time.perf_counter() - t0) * 1e3); res[c][1].append((time.process_time() - c0) * 1e3)
for c in (True, False):
    w, cp = res[c]
    print(f"{dt} batch {D} copy={c}: wall min {min(w):.2f} med {statistics.median(w):.2f} ms, CPU min {min(cp):.2f} med {statistics.median(cp):.2f} ms")
print(f"load {os.getloadavg()[0]:.1f}")
