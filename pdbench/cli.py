"""``pdserve bench``: load generator for any OpenAI-compatible server, with vLLM's serving metrics.

Examples::

    pdserve bench --base-url http://127.0.0.1:8000 --workload random --input-len 128 --output-len 64 \\
        --ignore-eos --num-prompts 50 --request-rate 2 --goodput ttft:1000 tpot:100 --save-result --plot
    pdserve bench --workload sharegpt --request-rate 0.5,1,2,inf --max-concurrency 8 --goodput tpot:80 \\
        --save-result --plot --result-dir bench/results
    pdserve bench --workload multiturn --endpoint chat --num-conversations 4 --num-turns 8 \\
        --input-len 50 --output-len 32 --ignore-eos --max-concurrency 4
    pdserve bench --workload system-prompt --prefix-len 1800 --input-len 200 --num-prefixes 1 \\
        --num-prompts 8 --max-concurrency 1 --vocab-size 49152

Each request rate of ``--request-rate`` (comma-separated) is one run over the same prompts; with
more than one rate and ``--goodput``, ``--plot`` also draws goodput and SLO attainment versus rate.
``--workload multiturn`` runs ``--num-conversations`` conversations of ``--num-turns`` turns: each
turn sends the whole history (the answers the server gave included) plus a new user message of
``--input-len`` words; turns of one conversation in sequence, conversations concurrent (the rate and
``--max-concurrency`` apply to conversations); it also prints TTFT per turn.
Metric definitions: :mod:`pdbench.metrics`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import sys
from pathlib import Path

import httpx

from .client import ENDPOINTS, RequestOptions, fetch_model
from .metrics import compute_metrics, parse_goodput
from .plan import ALL_WORKLOADS, RunOutcome, execute, plan_from_args
from .report import fmt_rate, format_sweep, format_table, format_turns, plot_cdfs, plot_goodput, write_json
from .runner import RunSettings, make_client, warm_up


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,inf"`` → ``[0.5, 1.0, inf]``. Raises ValueError."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity") else float(part)
        if not rate > 0:
            raise ValueError(f"request rate must be > 0 or 'inf', got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server or orchestrator base URL")
    g.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions (/v1/completions) or chat (/v1/chat/completions)")
    g.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    g.add_argument("--no-stream", action="store_true", help="non-streamed requests (TTFT = E2EL, no ITL)")
    g.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=ALL_WORKLOADS, default="random")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (median for sharegpt, suffix for prefix/system-prompt, user message for multiturn)")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens (median for sharegpt)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random/prefix: lengths in [n(1-r), n(1+r)]")
    g.add_argument("--max-input-len", type=int, default=1024, help="sharegpt: clip prompt lengths")
    g.add_argument("--max-output-len", type=int, default=512, help="sharegpt: clip output lengths")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix/system-prompt: shared prefix tokens")
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix/system-prompt: distinct shared prefixes")
    g.add_argument("--prefix-order", choices=("cycle", "shuffle"), default="cycle",
                   help="prefix/system-prompt: prefixes round robin, or each round in a seeded random order")
    g.add_argument("--num-conversations", type=int, default=8, help="multiturn: conversations")
    g.add_argument("--num-turns", type=int, default=4, help="multiturn: turns per conversation")
    g.add_argument("--system-prompt-len", type=int, default=0,
                   help="multiturn: words of a system prompt shared by every conversation (0 = none)")
    g.add_argument("--long-fraction", type=float, default=0.25, help="mixed: fraction of long prompts")
    g.add_argument("--long-input-len", type=int, default=1024, help="mixed: long prompt tokens")
    g.add_argument("--long-output-len", type=int, default=8, help="mixed: output tokens of long prompts")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="ids: `prompt: [token ids]` (exact lengths); text: words (~1 token each)")
    g.add_argument("--vocab-size", type=int, default=32000, help="ids are drawn from [256, vocab-size)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (server must support it)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf",
                   help="requests/s of a Poisson process, 'inf' = all at once; comma-separated values sweep")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests before each run")
    g.add_argument("--max-duration", type=float, default=1800.0, help="seconds per run; then in-flight requests are cut")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (any subset)")
    g.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    g.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("output")
    g.add_argument("--save-result", action="store_true", help="write the JSON result file")
    g.add_argument("--result-dir", default=".", help="where JSON and PNG files go")
    g.add_argument("--result-filename", default=None, help="JSON file name (default: pdbench-<workload>-<time>.json)")
    g.add_argument("--plot", action="store_true", help="write PNG plots next to the JSON file")
    g.add_argument("--label", default="", help="free text stored in the JSON (e.g. the layout measured)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def _per_request(outcome: RunOutcome) -> dict:
    records = outcome.records
    per = {
        "ok": [r.ok for r in records],
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts_ms": [r.ttft * 1000 if r.ok else None for r in records],
        "tpots_ms": [(r.tpot * 1000 if r.tpot is not None else None) if r.ok else None for r in records],
        "e2els_ms": [r.e2el * 1000 if r.ok else None for r in records],
        "itls_ms": [[g * 1000 for g in r.itl] if r.ok else [] for r in records],
        "cached_tokens": [r.cached_tokens if r.ok else 0 for r in records],
        "errors": [r.error for r in records],
    }
    if outcome.positions:
        per["conversation"] = [c for c, _ in outcome.positions]
        per["turn"] = [t for _, t in outcome.positions]
    return per


async def run_sweep(args: argparse.Namespace, out=sys.stdout) -> dict:
    """Run every request rate of ``args``; print tables to ``out``; return the result document.

    Raises:
        ValueError: bad arguments. RuntimeError: every warm-up request failed.
    """
    rates = parse_rates(args.request_rate)
    slos = parse_goodput(args.goodput)
    percentiles = tuple(float(x) for x in args.percentiles.split(","))
    extra = json.loads(args.extra_body)
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    plan = plan_from_args(args)
    warm = plan.warmup
    base_url = args.base_url.rstrip("/")
    doc = {"tool": "pdserve bench", "date": _dt.datetime.now().isoformat(timespec="seconds"), "label": args.label,
           "base_url": base_url, "endpoint": ENDPOINTS[args.endpoint], "workload": plan.workload,
           "ignore_eos": args.ignore_eos, "stream": not args.no_stream, "goodput_slos_ms": slos,
           "percentiles": list(percentiles), "runs": []}
    for rate in rates:
        settings = RunSettings(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                               max_duration_s=args.max_duration, request_timeout_s=args.request_timeout,
                               seed=args.seed, progress=not args.disable_tqdm)
        async with make_client(settings, args.max_concurrency) as client:
            if "model" not in doc:
                try:
                    doc["model"] = args.model or await fetch_model(client, base_url)
                except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
                    raise RuntimeError(f"cannot read the model id from {base_url}/v1/models: {err}") from None
            opts = RequestOptions(base_url=base_url, model=doc["model"], endpoint=args.endpoint,
                                  stream=not args.no_stream, ignore_eos=args.ignore_eos,
                                  temperature=args.temperature, extra_body=extra)
            if warm:
                warm_recs = await warm_up(client, warm, opts, args.max_concurrency or len(warm))
                if not any(r.ok for r in warm_recs):
                    raise RuntimeError(f"every warm-up request failed: {warm_recs[0].error}")
            outcome = await execute(plan, client, opts, settings, percentiles, desc=f"rate {fmt_rate(rate)}")
        m = compute_metrics(outcome.records, outcome.duration_s, slos, percentiles)
        conc = args.max_concurrency or "-"
        print(format_table(m, f"pdserve bench: rate {fmt_rate(rate)}, concurrency {conc}"), file=out)
        if outcome.turns is not None:
            print(format_turns(outcome.turns), file=out)
        errors = sorted({r.error for r in outcome.records if not r.ok})
        for e in errors[:5]:
            print(f"  failed: {e}", file=out)
        run = {"request_rate": rate, "max_concurrency": args.max_concurrency, "burstiness": args.burstiness,
               "metrics": m.to_dict(), "errors": errors[:20], "requests": _per_request(outcome)}
        if outcome.turns is not None:
            run["turns"] = outcome.turns
        doc["runs"].append(run)
    if len(doc["runs"]) > 1:
        print(format_sweep(doc["runs"]), file=out)
    return doc


def save_outputs(doc: dict, args: argparse.Namespace, out=sys.stdout) -> list[Path]:
    """Write the JSON (``--save-result``) and PNG (``--plot``) files; return their paths."""
    written: list[Path] = []
    result_dir = Path(args.result_dir)
    stem = args.result_filename or f"pdbench-{args.workload}-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    json_path = result_dir / stem
    if args.save_result:
        written.append(write_json(doc, json_path))
    if args.plot:
        base = json_path.with_suffix("")
        written.append(plot_cdfs(doc["runs"], Path(f"{base}-cdf.png"), doc["goodput_slos_ms"]))
        if len(doc["runs"]) > 1 and doc["goodput_slos_ms"]:
            written.append(plot_goodput({doc.get("label") or doc["model"]: doc["runs"]},
                                        Path(f"{base}-goodput.png")))
        elif len(doc["runs"]) > 1:
            print("note: goodput plot needs --goodput", file=out)
    for p in written:
        print(f"wrote {p}", file=out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        doc = asyncio.run(run_sweep(args))
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    save_outputs(doc, args)
    total = sum(r["metrics"]["num_requests"] for r in doc["runs"])
    failed = sum(r["metrics"]["failed"] for r in doc["runs"])
    return 0 if failed == 0 else (1 if failed == total else 2)


if __name__ == "__main__":
    sys.exit(main())
