"""The cost of a structured-output grammar mask per decode step, in ms, at batch 1 and 8.

    .venv/bin/python bench/grammar_mask.py [--model smollm2] [--threads 2] [--repeats 3]
        [--steps 32] [--skip-engine] [--json out.json]

1. One-time costs: llguidance's view of the vocabulary (``LLTokenizer``, once per server), the
   compile (+ validation) of each spec (once per spec: cached), a matcher (once per request).
2. Per step, for B matchers walking a real output of each grammar token by token: **fill** (each
   matcher writes its bitmask: llguidance's mask computation), **apply** (the bitmask to the
   device, unpacked to [B, V] bool, EOS ids shared, logits of disallowed tokens set to -inf:
   ``engine.grammar_mask``), **advance** (each matcher consumes its token). Median ms over the steps.
3. Engine decode steps (``LLMEngine.step()``, the whole step: forward, masks, sampling,
   detokenization) at batch B, greedy, with and without a JSON-schema grammar whose long string
   field keeps every row constrained for ``--steps`` steps; median wall ms per step.

Each number is the median over ``--repeats`` runs. On a loaded machine read them as rough and
report the load average (printed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.grammar_mask import GrammarRows, allowed_tokens, apply_grammar, fill_bitmask  # noqa: E402
from engine.structured_output import GrammarCompiler  # noqa: E402
from pdserve.config import EngineSettings  # noqa: E402
from pdserve.structured_output import StructuredOutputSpec  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "member"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40}, "member": {"type": "boolean"}}}
CASES = {  # spec, an output it allows (walked token by token)
    "json_schema": (StructuredOutputSpec(kind="json_schema", json_schema=SCHEMA),
                    '{"name": "Alice Johnson", "age": 34, "city": "San Francisco", "member": true}'),
    "json_object": (StructuredOutputSpec(kind="json_object"),
                    '{"title": "Notes", "items": [{"id": 1, "done": false}, {"id": 2, "tags": ["a", "b"]}]}'),
    "regex": (StructuredOutputSpec(kind="regex", regex=r"[0-9]{3}-[0-9]{4} [A-Za-z ]{1,40}"), "555-1234 Main Street"),
    "choice": (StructuredOutputSpec(kind="choice", choices=("positive", "negative", "neutral")), "negative"),
}
LONG = StructuredOutputSpec(kind="json_schema", json_schema={
    "type": "object", "additionalProperties": False, "required": ["text"],
    "properties": {"text": {"type": "string", "minLength": 2000}}})


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def one_time(tok, vocab: int, eos: list[int]) -> dict:
    c = GrammarCompiler(tok, vocab, eos)
    t0 = time.perf_counter()
    _ = c.tokenizer
    out = {"tokenizer_ms": ms(t0)}
    for name, (spec, _) in CASES.items():
        t0 = time.perf_counter()
        c.compile(spec)
        out[f"compile_{name}_ms"] = ms(t0)
        t0 = time.perf_counter()
        c.matcher(spec)
        out[f"matcher_{name}_ms"] = ms(t0)
    return out


def walk(compiler: GrammarCompiler, spec, tokens: list[int], batch: int) -> dict:
    """Median ms per step of fill / apply / advance for ``batch`` matchers walking ``tokens``."""
    matchers = [compiler.matcher(spec) for _ in range(batch)]
    vocab, dev = compiler.vocab_size, torch.device("cpu")
    logits = torch.randn(batch, vocab)
    fill, apply, advance = [], [], []
    for t in tokens:
        t0 = time.perf_counter()
        bits = fill_bitmask(matchers, vocab)
        fill.append(ms(t0))
        t0 = time.perf_counter()
        apply_grammar(logits, GrammarRows(list(range(batch)), allowed_tokens(bits, matchers, vocab, dev)))
        apply.append(ms(t0))
        t0 = time.perf_counter()
        ok = [m.accept(t) for m in matchers]
        advance.append(ms(t0))
        assert all(ok), "the sample output breaks its grammar"
    med = statistics.median
    return {"fill_ms": med(fill), "apply_ms": med(apply), "advance_ms": med(advance),
            "total_ms": med(fill) + med(apply) + med(advance), "steps": len(tokens)}


def decode_ms(engine: LLMEngine, batch: int, steps: int, spec) -> float:
    """Median wall ms of a decode step at ``batch``, greedy, every row under ``spec`` (or none)."""
    tok = engine.tokenizer
    for b in range(batch):
        p = tok.encode(f"Write a long story number {b} about the sea.")
        engine.add_request(EngineRequest(f"d{b}", p, SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                                    ignore_eos=spec is None, structured_output=spec)))
    for _ in range(100):  # prefills (untimed)
        engine.step()
        if len(engine.scheduler.running) == batch and all(s.num_computed + 1 >= s.num_tokens
                                                           for s in engine.scheduler.running):
            break
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(ms(t0))
    for b in range(batch):
        engine.abort_request(f"d{b}")
    while engine.has_work():
        engine.step()
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}", flush=True)
    engine = LLMEngine(EngineSettings(dtype=args.dtype, device="cpu", num_kv_blocks=512, num_threads=args.threads),
                       args.model)
    tok, vocab = engine.tokenizer, engine.model_config.vocab_size
    results: dict = {"vocab": vocab, "one_time": one_time(tok, vocab, tok.eos_token_ids)}
    compiler = GrammarCompiler(tok, vocab, tok.eos_token_ids)
    for name, (spec, text) in CASES.items():
        tokens = tok.encode(text)
        for batch in (1, 8):
            runs = [walk(compiler, spec, tokens, batch) for _ in range(args.repeats)]
            results[f"{name}_b{batch}"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if not args.skip_engine:
        for batch in (1, 8):
            for label, spec in (("off", None), ("on", LONG)):
                results[f"engine_b{batch}_{label}_ms"] = statistics.median(
                    decode_ms(engine, batch, args.steps, spec) for _ in range(args.repeats))
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
