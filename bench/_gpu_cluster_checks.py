"""The cluster checks of bench/gpu_check.py: disaggregated == colocated behind the orchestrator, and
KV pull GB/s between two processes next to a same-device copy of the same bytes."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import httpx
import torch

from _harness import PY, Procs, orchestrator_url, server_url, write_topology


def _complete(url: str, model: str, prompt: list[int], n: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def check_disagg(model_dir: Path, prompts: list[list[int]], n: int, device: str, work: Path) -> dict:
    """A ctx and a gen server (two processes, one device) behind the orchestrator: the greedy text of
    each prompt through the orchestrator (disaggregated) == on the ctx server alone (colocated), fp32.

    On CUDA the KV cache is sized by gpu_memory_utilization 0.3 per server (two on one GPU) and
    moves over CUDA IPC; on a CPU it has 256 blocks and moves over TCP. Executors are in-process
    (the GPU host has no MPI launcher)."""
    engine = {"device": device, "dtype": "float32", "executor": "inproc", "max_batch_size": 8, "num_threads": 2}
    engine.update({"gpu_memory_utilization": 0.3, "num_kv_blocks": None} if device != "cpu" else {"num_kv_blocks": 256})
    cfg = work / "disagg.yaml"
    doc = write_topology(cfg, model_path=str(model_dir), model_name="gpu-check", engine=engine)
    with Procs(work / "logs") as procs:
        for role in ("ctx", "gen"):
            procs.start(role, [PY, "-m", f"{role}_worker", "--config", str(cfg), "--index", "0"])
        procs.start("orchestrator", [PY, "-m", "orchestrator", "--config", str(cfg)])
        for role in ("ctx", "gen"):
            procs.wait_http(role, server_url(doc, role) + "/health", 240)
        procs.wait_http("orchestrator", orchestrator_url(doc) + "/health", 240)
        colocated = [_complete(server_url(doc, "ctx"), "gpu-check", p, n) for p in prompts]
        disagg = [_complete(orchestrator_url(doc), "gpu-check", p, n) for p in prompts]
        metrics = httpx.get(server_url(doc, "gen") + "/metrics", timeout=10).text
    backend = next((line.split('kv_backend="')[1].split('"')[0] for line in metrics.splitlines()
                    if line.startswith("pdserve_server_info{")), None)
    bad = [i for i, (a, b) in enumerate(zip(colocated, disagg)) if a != b]
    return {"match": not bad, "prompts": len(prompts), "tokens": n, "mismatched_prompts": bad,
            "kv_backend": backend, "gen_kv_cache_bytes": _gauge(metrics, "pdserve_kv_cache_bytes")}


def _gauge(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _kv_layout():
    """16 layers x K,V x 16 tokens x 8 heads x 64 dims x 4 bytes = 1 MiB per block (llama1b-like, fp32)."""
    from kv_transfer.layout import KVLayout

    return KVLayout(model="gpu-check", num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="float32")


BLOCK_SHAPE = (16, 2, 16, 8, 64)  # one block of _kv_layout: [layers, K/V, tokens, heads, dims] = 1 MiB fp32


def _ctx_process(device: str, num_blocks: int, conn) -> None:
    """Child: a cache of random blocks behind a CUDA IPC KV server with one parked lease of all blocks."""
    from kv_transfer.cuda_ipc_backend import CudaIpcKVServer
    from kv_transfer.lease import LeaseTable

    cache = torch.randn(num_blocks, *BLOCK_SHAPE, device=device)
    leases = LeaseTable(lambda rid, reason: None)
    leases.start()
    server = CudaIpcKVServer(cache, _kv_layout(), leases, "127.0.0.1", 0, 60.0)
    server.start()
    for i in range(8):  # one lease per timed pull
        leases.park(f"l{i}", list(range(num_blocks)), num_tokens=16 * num_blocks, ttl_s=120)
    conn.send((server.endpoint, cache[:4].sum().item()))
    # Until the parent is done (it says so, or its end of the pipe closes), at most 10 minutes.
    if conn.poll(600):
        conn.recv()
    server.stop()
    leases.stop()


def check_kv_pull(device: str, mib: int, repeats: int = 3) -> dict:
    """GB/s (bytes per second / 1e9) of pulling ``mib`` MiB of KV from another process, next to a
    copy of the same bytes within one device (``dst.copy_(src)``); best of ``repeats``."""
    from kv_transfer.cuda_ipc_backend import CudaIpcKVClient

    num_blocks = mib  # 1 MiB blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ctx_process, args=(device, num_blocks, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(180):
            raise TimeoutError("the ctx process did not start its KV server in 180 s")
        endpoint, checksum = parent.recv()
        dst = torch.zeros(num_blocks, *BLOCK_SHAPE, device=device)
        client = CudaIpcKVClient(_kv_layout())
        pulls = []
        for i in range(repeats):
            t0 = time.perf_counter()
            nbytes = client.pull(endpoint, f"l{i}", _kv_layout(), dst, list(range(num_blocks)), 60.0)
            pulls.append(time.perf_counter() - t0)
        ok = abs(dst[:4].sum().item() - checksum) < 1e-3 * max(1.0, abs(checksum))
        src = torch.randn_like(dst)
        copies = []
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            if device != "cpu":
                torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        client.stop()
        parent.send("done")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    pull_gbs, copy_gbs = nbytes / min(pulls) / 1e9, nbytes / min(copies) / 1e9
    return {"bytes": nbytes, "data_ok": ok, "transport": "cudaipc" if device != "cpu" else "tcp (cpu fallback)",
            "pull_gb_s": round(pull_gbs, 2), "copy_gb_s": round(copy_gbs, 2), "ratio": round(pull_gbs / copy_gbs, 3)}
