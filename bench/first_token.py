"""Experiment: TTFT of the disaggregated path (orchestrator → ctx → gen) vs the ctx server's own TTFT,
at concurrency 1, SmolLM2 (issue 13 part 2: the ctx server's first token is streamed at once), for
each dispatch style (``orchestrator.schedule_style``).

    .venv/bin/python bench/first_token.py [--repeats 3] [--num-prompts 20] [--input-len 256] \
        [--styles context_first,generation_first]

- one ctx server pinned to core 0, one gen server on core 1 (``num_threads 1`` each, KV over TCP),
  and one orchestrator per style in ``--styles`` (unpinned; the same two servers are members of
  each, and only one orchestrator carries traffic at a time);
- "ctx server": the same prompts sent straight to the ctx server (colocated there: its own prefill
  and first token, no orchestrator, no KV handoff);
- "disaggregated <style>": through that style's orchestrator; its first chunk is the ctx server's
  first token (generation_first: the gen request left with the ctx request and waits for its KV).

Each repeat runs every target back to back (``pdserve bench``, streamed, ``--max-concurrency 1``,
random prompts of ``--input-len`` tokens, ``--output-len`` tokens each); cells are medians over the
repeats. Writes the ``first_token`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (PY, RESULTS, Procs, bench, conditions, free_port, loadavg, md_table, median,  # noqa: E402
                      orchestrator_url, say, server_url, update_section, write_topology)

BASE = "ctx server"
STYLES = ("context_first", "generation_first")


def target_name(style: str) -> str:
    return f"disaggregated {style}"


def style_topology(doc: dict, style: str, path: Path, own_port: bool) -> dict:
    """``doc`` with ``orchestrator.schedule_style: style`` (and, ``own_port``, a free port of its own:
    a second orchestrator over the same servers), written to ``path``."""
    out = copy.deepcopy(doc)
    out["orchestrator"]["schedule_style"] = style
    if own_port:
        out["orchestrator"]["port"] = free_port()
    path.write_text(yaml.safe_dump(out, sort_keys=False))
    return out


def start(procs: Procs, dtype: str, styles: list[str]) -> dict[str, str]:
    """Start the servers and one orchestrator per style; return each target's URL."""
    cfg = RESULTS / "first_token" / "cluster.yaml"
    # No prefix cache: every target sees the same prompts, and a hit would hide the prefill.
    doc = write_topology(cfg, engine={"dtype": dtype, "num_threads": 1, "enable_prefix_caching": False})
    procs.start("ctx", [PY, "-m", "ctx_worker", "--config", str(cfg), "--index", "0"], cores="0")
    procs.start("gen", [PY, "-m", "gen_worker", "--config", str(cfg), "--index", "0"], cores="1")
    urls = {BASE: server_url(doc, "ctx")}
    for i, style in enumerate(styles):  # the first keeps the file's port: the servers register there
        path = cfg.with_name(f"cluster-{style}.yaml")
        sdoc = style_topology(doc, style, path, own_port=i > 0)
        procs.start(f"orchestrator-{style}", [PY, "-m", "orchestrator", "--config", str(path)])
        urls[target_name(style)] = orchestrator_url(sdoc)
    for name, url in (("ctx", server_url(doc, "ctx")), ("gen", server_url(doc, "gen")),
                      *((f"orchestrator-{st}", urls[target_name(st)]) for st in styles)):
        procs.wait_http(name, url + "/health", 300)
    return urls


def bench_argv(url: str, a: argparse.Namespace, seed: int) -> list[str]:
    return ["--base-url", url, "--model", "SmolLM2-135M-Instruct", "--workload", "random",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--range-ratio", "0",
            "--ignore-eos", "--num-prompts", str(a.num_prompts), "--request-rate", "inf",
            "--max-concurrency", "1", "--seed", str(seed), "--num-warmups", "2", "--disable-tqdm",
            "--max-duration", str(a.max_duration)]


def measure(a: argparse.Namespace) -> dict[str, list[dict]]:
    with Procs(RESULTS / "first_token" / "logs") as procs:
        urls = start(procs, a.dtype, a.styles)
        raw: dict[str, list[dict]] = {t: [] for t in urls}
        for rep in range(a.repeats):
            for target in urls:
                m = bench(bench_argv(urls[target], a, seed=rep))["runs"][0]["metrics"]
                raw[target].append(m)
                say(f"repeat {rep} {target}: TTFT p50 {m['ttft_ms']['median']:.1f} ms, "
                    f"E2EL p50 {m['e2el_ms']['median']:.0f} ms, failed {m['failed']}")
    return raw


def report(raw: dict[str, list[dict]], a: argparse.Namespace, load0: float) -> str:
    targets = list(raw)
    cell = {t: {k: median([m[k]["median"] for m in raw[t]]) for k in ("ttft_ms", "e2el_ms", "tpot_ms")}
            for t in targets}
    base = cell[BASE]["ttft_ms"]
    rows = [[t, f"{cell[t]['ttft_ms']:.1f}", f"{cell[t]['ttft_ms'] / base:.2f}×", f"{cell[t]['tpot_ms']:.1f}",
             f"{cell[t]['e2el_ms']:.0f}", sum(m["failed"] for m in raw[t])] for t in targets]
    cmd = (f"`.venv/bin/python bench/first_token.py --repeats {a.repeats} --num-prompts {a.num_prompts} "
           f"--input-len {a.input_len} --output-len {a.output_len} --dtype {a.dtype} --styles {','.join(a.styles)}`")
    per_repeat = [f"{t.removeprefix('disaggregated ')}: " + ", ".join(
        f"{d['ttft_ms']['median']:.0f} / {c['ttft_ms']['median']:.0f} ms = "
        f"{d['ttft_ms']['median'] / c['ttft_ms']['median']:.2f}×" for c, d in zip(raw[BASE], raw[t]))
        for t in targets if t != BASE]
    return "\n".join([
        "## First token at once: disaggregated TTFT vs the ctx server's own (issue 13 part 2)", "",
        f"{cmd}: SmolLM2 {a.dtype}, ctx server on core 0 and gen server on core 1 (one thread each), "
        f"one orchestrator per dispatch style over those two servers, "
        f"{a.num_prompts} random prompts of {a.input_len} tokens, {a.output_len} output tokens, "
        f"concurrency 1, streamed, prefix cache off (every target gets the same prompts); medians of "
        f"{a.repeats} repeats (per-repeat p50s).", "",
        md_table(["target", "TTFT p50 (ms)", "vs ctx server", "TPOT p50 (ms)", "E2EL p50 (ms)", "failed"], rows), "",
        "The orchestrator streams the ctx answer's first token as soon as that answer arrives, in either "
        "style (goal: ≤ 1.15× the ctx server's own TTFT); the gen server's stream, which starts with the "
        "same token after its KV pull, is merged in without repeating it. With generation_first the gen "
        "request left with the ctx request and its server waited for the KV (`POST /disagg/lease`). The "
        "ctx server's own E2EL runs the whole decode on core 0; the disaggregated E2EL adds the KV "
        "handoff and runs decode on core 1.", "",
        "Per repeat (same-repeat ratio, disaggregated / ctx server TTFT p50) — " + "; ".join(per_repeat) + ".", "",
        conditions(load0),
    ])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per run")
    p.add_argument("--styles", default=",".join(STYLES),
                   help="orchestrator.schedule_style values, one orchestrator each (comma-separated)")
    a = p.parse_args()
    a.styles = a.styles.split(",")
    if not a.styles or any(st not in STYLES for st in a.styles):
        p.error(f"--styles takes a comma-separated subset of {', '.join(STYLES)}")
    load0 = loadavg()
    t0 = time.monotonic()
    raw = measure(a)
    update_section("first_token", report(raw, a, load0))
    say(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
