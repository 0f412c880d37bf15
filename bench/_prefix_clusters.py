"""Clusters and server counters of bench/prefix_cache.py.

- :func:`start_on_off`: two 1 ctx + 1 gen clusters, prefix caching on and off, each with its own
  orchestrator (ctx servers pinned to core 0, gen servers to core 1; they take turns, never load
  the cores at once).
- :func:`start_two_ctx`: for the cache-capacity experiment, two ctx servers of ``blocks`` KV blocks
  each behind two orchestrators (``kv_cache_aware`` and ``round_robin`` ctx routers), and one ctx
  server of ``2 * blocks`` behind a third; one gen server serves all three.
- :func:`counters` / :func:`reset`: a server's prefix-cache and request counters from ``/metrics``,
  ``POST /reset_prefix_cache`` (admin token ``ADMIN_TOKEN``, given to every server started here).
"""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from _harness import PY, Procs, free_port, orchestrator_url, server_url, write_topology

ADMIN_TOKEN = "prefix-cache-bench"
ENV = {"PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN}


def _start_servers(procs: Procs, name: str, cfg: Path, doc: dict, roles=("ctx", "gen")) -> list[tuple[str, str]]:
    started = []
    for role in roles:
        for i in range(len(doc["pools"][role]["servers"])):
            proc = f"{name}-{role}{i}"
            procs.start(proc, [PY, "-m", f"{role}_worker", "--config", str(cfg), "--index", str(i)],
                        cores="0" if role == "ctx" else "1", env=ENV)
            started.append((proc, server_url(doc, role, i) + "/health"))
    return started


def _start_orchestrator(procs: Procs, name: str, cfg: Path, doc: dict) -> tuple[str, str]:
    procs.start(f"{name}-orch", [PY, "-m", "orchestrator", "--config", str(cfg)], env=ENV)
    return f"{name}-orch", orchestrator_url(doc) + "/health"


def _wait(procs: Procs, waits: list[tuple[str, str]], timeout_s: float = 600.0) -> None:
    for proc, url in waits:
        procs.wait_http(proc, url, timeout_s)


def start_on_off(procs: Procs, out_dir: Path, engine: dict) -> dict[str, str]:
    """Start the caching-on and caching-off clusters; return {"on": url, "off": url} (orchestrators)."""
    urls, waits = {}, []
    for layout, enabled in (("on", True), ("off", False)):
        cfg = out_dir / f"{layout}.yaml"
        doc = write_topology(cfg, engine={**engine, "enable_prefix_caching": enabled})
        waits += _start_servers(procs, layout, cfg, doc)
        waits.append(_start_orchestrator(procs, layout, cfg, doc))
        urls[layout] = orchestrator_url(doc)
    _wait(procs, waits)
    return urls


def _dump(doc: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_two_ctx(procs: Procs, out_dir: Path, engine: dict, blocks: int) -> dict[str, dict]:
    """Start the capacity layouts; return per layout its orchestrator URL and ctx server URLs.

    ``kv_cache_aware`` and ``round_robin``: the same two ctx servers (``blocks`` KV blocks each);
    ``one_server``: one ctx server of ``2 * blocks``. One gen server behind all three.
    """
    kv_cfg = out_dir / "two_ctx_kv.yaml"
    kv = write_topology(kv_cfg, engine=engine, ctx_engine={"num_kv_blocks": blocks}, num_ctx=2)
    kv["pools"]["ctx"]["router"] = "kv_cache_aware"
    kv["pools"]["gen"]["router"] = "round_robin"
    rr = copy.deepcopy(kv)
    rr["pools"]["ctx"]["router"] = "round_robin"
    rr["orchestrator"]["port"] = free_port()
    one = copy.deepcopy(rr)
    one["pools"]["ctx"]["servers"] = [{"host": "127.0.0.1", "port": free_port()}]
    one["pools"]["ctx"]["engine"] = {"num_kv_blocks": 2 * blocks}
    one["orchestrator"]["port"] = free_port()
    cfgs = {"kv_cache_aware": _dump(kv, kv_cfg), "round_robin": _dump(rr, out_dir / "two_ctx_rr.yaml"),
            "one_server": _dump(one, out_dir / "one_ctx.yaml")}
    waits = _start_servers(procs, "two", cfgs["kv_cache_aware"], kv)
    waits += _start_servers(procs, "one", cfgs["one_server"], one, roles=("ctx",))
    docs = {"kv_cache_aware": kv, "round_robin": rr, "one_server": one}
    for name, cfg in cfgs.items():
        waits.append(_start_orchestrator(procs, name, cfg, docs[name]))
    _wait(procs, waits)
    return {name: {"url": orchestrator_url(d),
                   "ctx": [server_url(d, "ctx", i) for i in range(len(d["pools"]["ctx"]["servers"]))]}
            for name, d in docs.items()}


def counters(url: str) -> dict[str, float]:
    """``prefix_cache_queries``/``prefix_cache_hits`` (tokens) and ``context_requests`` (finished
    context_only requests) of one server's ``/metrics``. Raises httpx.HTTPError."""
    r = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False)
    r.raise_for_status()
    out = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0, "context_requests": 0.0}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "pdserve_prefix_cache_queries_total":
                out["prefix_cache_queries"] += s.value
            elif s.name == "pdserve_prefix_cache_hits_total":
                out["prefix_cache_hits"] += s.value
            elif s.name == "pdserve_server_requests_total" and s.labels.get("request_type") == "context_only":
                out["context_requests"] += s.value
    return out


def reset(url: str) -> None:
    """Empty one server's prefix cache. Raises httpx.HTTPError (non-2xx included)."""
    r = httpx.post(f"{url}/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                   timeout=30.0, trust_env=False)
    r.raise_for_status()
