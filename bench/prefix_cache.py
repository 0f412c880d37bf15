"""Experiment: what the prefix cache buys on the disaggregated path (issue 10), SmolLM2 through
the orchestrator, caching on and off in the same run.

    .venv/bin/python bench/prefix_cache.py [--experiments shared,multiturn,capacity] [--repeats 2]

- ``shared`` (a): ``--shared-prompts`` prompts of ``--shared-len`` tokens sharing their first
  ``--shared-prefix`` (2,000 / 1,800), one at a time → TTFT p50 with caching on vs off.
- ``multiturn`` (b): ``--conversations`` concurrent conversations of ``--turns`` turns (user
  message ~``--user-len`` tokens, answers exactly ``--answer-len`` tokens: ``ignore_eos``) → turn-N
  TTFT p50 over turn-1 TTFT p50, on and off.
- ``capacity`` (c): two ctx servers of ``--ctx-blocks`` KV blocks each and a prefix workload whose
  prefixes fit in both caches together but not in one → hit rate of ``kv_cache_aware`` vs
  ``round_robin`` (the same two servers) vs one ctx server of ``2 × --ctx-blocks``, and the share of
  requests each server took. The ctx caches are emptied (``POST /reset_prefix_cache``) before each.

Hit rate = hit prompt tokens / prompt tokens: from the answers
(``usage.prompt_tokens_details.cached_tokens``, the ctx server's hit) and from the ctx servers'
``pdserve_prefix_cache_hits_total / _queries_total``. Layouts: ctx servers pinned to core 0, gen
servers to core 1, one torch thread each, KV over TCP; the on and off clusters stay up for the whole
run and take turns (never loaded at once). Every run gets a fresh ``cache_salt``, so no run hits
blocks an earlier repeat left. Each experiment rewrites its own section of docs/benchmarks.md;
raw results go to bench/results/prefix_cache/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import RESULTS, Procs, bench, conditions, loadavg, md_table, median, say, update_section  # noqa: E402
from _prefix_clusters import counters, reset, start_on_off, start_two_ctx  # noqa: E402

OUT = RESULTS / "prefix_cache"
MODEL = "SmolLM2-135M-Instruct"
EXPERIMENTS = ("shared", "multiturn", "capacity")


def salt(tag: str) -> str:
    return json.dumps({"cache_salt": f"{tag}-{uuid.uuid4().hex[:12]}"})


def common(url: str, a: argparse.Namespace, seed: int) -> list[str]:
    return ["--base-url", url, "--model", MODEL, "--seed", str(seed), "--disable-tqdm",
            "--max-duration", str(a.max_duration), "--request-timeout", str(a.max_duration)]


def shared_argv(url: str, a: argparse.Namespace, seed: int) -> list[str]:
    return common(url, a, seed) + [
        "--workload", "system-prompt", "--prefix-len", str(a.shared_prefix),
        "--input-len", str(a.shared_len - a.shared_prefix), "--num-prefixes", "1", "--num-prompts", str(a.shared_prompts),
        "--output-len", "4", "--ignore-eos", "--max-concurrency", "1", "--vocab-size", "49152", "--num-warmups", "1",
        "--extra-body", salt("shared")]


def multiturn_argv(url: str, a: argparse.Namespace, seed: int) -> list[str]:
    return common(url, a, seed) + [
        "--workload", "multiturn", "--endpoint", "chat", "--num-conversations", str(a.conversations),
        "--num-turns", str(a.turns), "--input-len", str(a.user_len), "--output-len", str(a.answer_len), "--ignore-eos",
        "--max-concurrency", str(a.conversations), "--num-warmups", "1", "--extra-body", salt("multiturn")]


def capacity_argv(url: str, a: argparse.Namespace, seed: int) -> list[str]:
    return common(url, a, seed) + [
        "--workload", "prefix", "--prefix-order", "shuffle", "--num-prefixes", str(a.cap_prefixes),
        "--prefix-len", str(a.cap_prefix_len), "--input-len", str(a.cap_suffix_len),
        "--num-prompts", str(a.cap_prefixes * a.cap_rounds), "--output-len", "2", "--ignore-eos",
        "--max-concurrency", "1", "--vocab-size", "49152", "--num-warmups", "0", "--extra-body", salt("capacity")]


def run_on_off(urls: dict[str, str], argv, a: argparse.Namespace, name: str) -> dict[str, list[dict]]:
    """Alternate on/off for ``a.repeats`` repeats; return each layout's bench runs."""
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for rep in range(a.repeats):
        for layout in ("on", "off"):
            run = bench(argv(urls[layout], a, rep))["runs"][0]
            runs[layout].append(run)
            m = run["metrics"]
            say(f"{name} repeat {rep} {layout}: TTFT p50 {m['ttft_ms']['median']:.0f} ms, hit rate "
                f"{100 * m['prefix_hit_rate']:.1f}%, failed {m['failed']}")
    (OUT / f"{name}.json").write_text(json.dumps(runs, indent=2, default=str))
    return runs


def head(t0: float, load0: float, title: str, a: argparse.Namespace) -> str:
    cmd = shlex.join(["python", "bench/prefix_cache.py"] + sys.argv[1:])
    flags = "avx512_bf16" if "avx512_bf16" in Path("/proc/cpuinfo").read_text() else "no avx512_bf16 (bf16 emulated)"
    return (f"## {title}\n\nCommand (took {(time.monotonic() - t0) / 60:.1f} min): `{cmd}`\n\n{conditions(load0)} "
            f"CPU flags: {flags}; engine dtype `{a.dtype}`.\n")


def shared_section(runs: dict[str, list[dict]], a: argparse.Namespace, header: str) -> str:
    p50 = {k: median([r["metrics"]["ttft_ms"]["median"] for r in v]) for k, v in runs.items()}
    hit = {k: median([r["metrics"]["prefix_hit_rate"] for r in v]) for k, v in runs.items()}
    rows = [[k, f"{p50[k]:.0f}", f"{100 * hit[k]:.1f}",
             " / ".join(f"{r['metrics']['ttft_ms']['median']:.0f}" for r in runs[k]),
             sum(r["metrics"]["failed"] for r in runs[k])] for k in ("on", "off")]
    ratio = p50["off"] / p50["on"]
    verdict = "meets" if ratio >= 3 else "misses"
    return f"""{header}
1 ctx + 1 gen + orchestrator per layout; {a.shared_prompts} prompts of {a.shared_len} token ids sharing their
first {a.shared_prefix} (`pdserve bench --workload system-prompt`), one at a time, 4 output tokens, per repeat
(a fresh `cache_salt` each: the first prompt of a repeat computes the prefix, the rest reuse it). Cells:
median over {a.repeats} repeats of each repeat's TTFT p50.

{md_table(["caching", "TTFT p50 ms", "hit rate %", "TTFT p50 per repeat", "failed"], rows)}

**Reading:** caching off / on = {ratio:.1f}× TTFT p50 ({verdict} the issue's line: ≥ 3× lower with caching).
"""


def turn_p50(run: dict, turn: int) -> float:
    return run["turns"][turn - 1]["ttft_ms"]["median"]


def multiturn_section(runs: dict[str, list[dict]], a: argparse.Namespace, header: str) -> str:
    rows, ratio = [], {}
    for k in ("on", "off"):
        for t in range(1, a.turns + 1):
            ttft = median([turn_p50(r, t) for r in runs[k]])
            hit = median([r["turns"][t - 1]["prefix_hit_rate"] for r in runs[k]])
            ptok = median([r["turns"][t - 1]["mean_prompt_tokens"] for r in runs[k]])
            ctok = median([r["turns"][t - 1]["mean_prompt_tokens"] - r["turns"][t - 1]["mean_cached_tokens"]
                           for r in runs[k]])
            rows.append([k, t, f"{ptok:.0f}", f"{ctok:.0f}", f"{100 * hit:.1f}", f"{ttft:.0f}"])
        ratio[k] = median([turn_p50(r, a.turns) / turn_p50(r, 1) for r in runs[k]])
    on_ok, off_ok = ratio["on"] <= 1.5, ratio["off"] <= 1.5
    verdict = ("meets" if on_ok and not off_ok else "misses") + " the issue's line (on within 1.5×, off not)"
    failed = {k: sum(r["metrics"]["failed"] for r in v) for k, v in runs.items()}
    return f"""{header}
1 ctx + 1 gen + orchestrator per layout; `pdserve bench --workload multiturn --endpoint chat`:
{a.conversations} concurrent conversations of {a.turns} turns, each turn the whole history (the answers the
server gave) plus a new user message of ~{a.user_len} words, answers exactly {a.answer_len} tokens
(`ignore_eos`). Cells: median over {a.repeats} repeats of each turn's TTFT p50 (over the conversations);
prompt tokens from `usage`. Failed requests: on {failed['on']}, off {failed['off']}.

{md_table(["caching", "turn", "prompt tokens", "computed tokens", "hit rate %", "TTFT p50 ms"], rows)}

**Reading:** turn-{a.turns} / turn-1 TTFT p50 = {ratio['on']:.2f}× with caching, {ratio['off']:.2f}× without
({verdict}; per repeat: on {', '.join(f"{turn_p50(r, a.turns) / turn_p50(r, 1):.2f}" for r in runs['on'])}, off
{', '.join(f"{turn_p50(r, a.turns) / turn_p50(r, 1):.2f}" for r in runs['off'])}). "Computed
tokens" = prompt − cached on the ctx server: it holds the previous turn's *prompt*, but the previous
*answer* was decoded on the gen server, so the ctx server computes it again with the new message (the
gen server then pulls only the blocks it lacks: partial pulls). A ctx server pulling the decoded
blocks back from the gen server is not built.
"""


def capacity_run(layout: dict, a: argparse.Namespace, seed: int) -> dict:
    """Empty the layout's ctx caches, run the workload, return hit rates and request shares."""
    for url in layout["ctx"]:
        reset(url)
    before = [counters(u) for u in layout["ctx"]]
    m = bench(capacity_argv(layout["url"], a, seed))["runs"][0]["metrics"]
    after = [counters(u) for u in layout["ctx"]]
    delta = [{k: x[k] - b[k] for k in x} for b, x in zip(before, after)]
    q = sum(d["prefix_cache_queries"] for d in delta)
    n = sum(d["context_requests"] for d in delta)
    return {"metrics": m, "servers": delta,
            "server_hit_rate": sum(d["prefix_cache_hits"] for d in delta) / q if q else float("nan"),
            "shares": [d["context_requests"] / n if n else float("nan") for d in delta]}


def run_capacity(layouts: dict[str, dict], a: argparse.Namespace) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {k: [] for k in layouts}
    for rep in range(a.repeats):
        for name, layout in layouts.items():
            r = capacity_run(layout, a, rep)
            runs[name].append(r)
            say(f"capacity repeat {rep} {name}: hit rate {100 * r['metrics']['prefix_hit_rate']:.1f}% (servers "
                f"{100 * r['server_hit_rate']:.1f}%), shares {[round(s, 2) for s in r['shares']]}, "
                f"failed {r['metrics']['failed']}")
    (OUT / "capacity.json").write_text(json.dumps(runs, indent=2, default=str))
    return runs


def capacity_section(runs: dict[str, list[dict]], a: argparse.Namespace, header: str, router_note: str) -> str:
    hit = {k: median([r["metrics"]["prefix_hit_rate"] for r in v]) for k, v in runs.items()}
    rows = [[k, f"{100 * hit[k]:.1f}", f"{100 * median([r['server_hit_rate'] for r in v]):.1f}",
             " / ".join(f"{100 * max(r['shares']):.0f}" for r in v),
             f"{median([r['metrics']['ttft_ms']['median'] for r in v]):.0f}", sum(r["metrics"]["failed"] for r in v)]
            for k, v in runs.items()]
    bs, pb = 16, a.cap_prefix_len // 16
    prompt_blocks = -(-(a.cap_prefix_len + a.cap_suffix_len) // bs)
    worst = max(max(r["shares"]) for r in runs["kv_cache_aware"])
    rel = hit["kv_cache_aware"] / hit["one_server"] if hit["one_server"] else float("nan")
    return f"""{header}
Two ctx servers of {a.ctx_blocks} KV blocks each (block size {bs}), one gen server; {a.cap_prefixes} prefixes of
{a.cap_prefix_len} tokens ({pb} blocks each, {a.cap_prefixes * pb} in all) and a {a.cap_suffix_len}-token suffix per
request ({prompt_blocks} blocks per prompt), {a.cap_rounds} rounds of every prefix once in a seeded random order
(`pdserve bench --workload prefix --prefix-order shuffle`), one request at a time, 2 output tokens. Sizes:
one server holds at most {(a.ctx_blocks - prompt_blocks) // pb} prefixes beside the request in flight (< {a.cap_prefixes});
half of them ({a.cap_prefixes // 2 * pb} blocks) + the request in flight fit in one ({a.cap_prefixes // 2 * pb + prompt_blocks}
≤ {a.ctx_blocks}); one server of {2 * a.ctx_blocks} blocks holds all. The first round always misses, so
the best possible hit rate is {100 * (a.cap_rounds - 1) * a.cap_prefix_len / (a.cap_rounds * (a.cap_prefix_len + a.cap_suffix_len)):.1f}%.
Router: {router_note}. Cells: medians over {a.repeats} repeats; each run starts with empty ctx caches.

{md_table(["layout", "hit rate % (answers)", "hit rate % (ctx counters)", "busiest ctx server's share % per repeat",
           "TTFT p50 ms", "failed"], rows)}

**Reading:** `kv_cache_aware` reaches {100 * rel:.0f}% of the one-server hit rate (issue: ≥ 90%), its busiest
server took {100 * worst:.0f}% of the requests (issue: ≤ 65%), `round_robin` {100 * hit['round_robin']:.1f}% vs
`kv_cache_aware` {100 * hit['kv_cache_aware']:.1f}%.
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {EXPERIMENTS}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="engine.dtype of every server")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per bench run (and per request)")
    p.add_argument("--shared-len", type=int, default=2000)
    p.add_argument("--shared-prefix", type=int, default=1800)
    p.add_argument("--shared-prompts", type=int, default=5)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-len", type=int, default=50)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--ctx-blocks", type=int, default=96, help="capacity: KV blocks of each of the two ctx servers")
    p.add_argument("--cap-prefixes", type=int, default=8)
    p.add_argument("--cap-prefix-len", type=int, default=256)
    p.add_argument("--cap-suffix-len", type=int, default=32)
    p.add_argument("--cap-rounds", type=int, default=6)
    p.add_argument("--router-note", default="kv_cache_aware on the blocks each ctx server reports holding (its KV events)",
                   help="what the kv_cache_aware router routes on, for the doc")
    a = p.parse_args()
    a.experiments = [e for e in a.experiments.split(",") if e]
    bad = [e for e in a.experiments if e not in EXPERIMENTS]
    if bad:
        p.error(f"unknown experiments {bad}; choose from {EXPERIMENTS}")
    return a


def engine_settings(a: argparse.Namespace) -> dict:
    return {"dtype": a.dtype, "num_threads": 1, "num_kv_blocks": 512, "max_batch_size": 16, "max_num_tokens": 2048}


def main() -> int:
    a = parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with Procs(OUT / "logs") as procs:
        if {"shared", "multiturn"} & set(a.experiments):
            t0, load0 = time.monotonic(), loadavg()
            urls = start_on_off(procs, OUT, engine_settings(a))
            say(f"on/off clusters up after {time.monotonic() - t0:.0f} s: {urls}")
            for name, argv, section, title in (
                    ("shared", shared_argv, shared_section, "Prefix cache: 2,000-token prompts sharing 1,800"),
                    ("multiturn", multiturn_argv, multiturn_section, "Prefix cache: multi-turn conversations")):
                if name in a.experiments:
                    t1, load1 = time.monotonic(), loadavg()
                    runs = run_on_off(urls, argv, a, name)
                    update_section(f"prefix-cache-{name}", section(runs, a, head(t1, load1, title, a)))
            procs.stop_all()
        if "capacity" in a.experiments:
            t0, load0 = time.monotonic(), loadavg()
            layouts = start_two_ctx(procs, OUT, engine_settings(a), a.ctx_blocks)
            say(f"capacity layouts up after {time.monotonic() - t0:.0f} s")
            runs = run_capacity(layouts, a)
            title = "Prefix cache: two ctx servers, kv_cache_aware vs round_robin vs one big cache"
            update_section("prefix-cache-capacity", capacity_section(runs, a, head(t0, load0, title, a), a.router_note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
