"""Why llguidance: the three candidate grammar libraries on the SmolLM2 vocabulary (49,152 tokens).

    .venv/bin/pip install --no-deps --target /tmp/grammar-libs xgrammar==0.2.8 outlines-core==0.2.14
    PYTHONPATH=/tmp/grammar-libs .venv/bin/python bench/grammar_libraries.py [--repeats 3]

(llguidance is a dependency of pdserve; the other two go to a throw-away folder.) For each library
and each case (a 4-field JSON schema, free JSON, a regex) it times the one-time tokenizer
preparation, the compile of the case, and the per-step mask computation while walking a valid
output token by token (median ms per token). A library that cannot express a case says so
(outlines-core compiles schemas to a regex: no free-form, recursive JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "member"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40}, "member": {"type": "boolean"}}}
CASES = {
    "json_schema": ("schema", '{"name": "Alice Johnson", "age": 34, "city": "San Francisco", "member": true}'),
    "json_object": ("object", '{"title": "Notes", "items": [{"id": 1, "done": false}, {"id": 2, "tags": ["a", "b"]}]}'),
    "regex": ("regex", "555-1234 Main Street"),
}
REGEX = r"[0-9]{3}-[0-9]{4} [A-Za-z ]{1,40}"


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def run_llguidance(hf, vocab: int, cases: dict) -> dict:
    import llguidance
    import llguidance.hf
    import torch

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    out = {"tokenizer_ms": ms(t0)}
    opts = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
    for name, (kind, tokens) in cases.items():
        t0 = time.perf_counter()
        g = {"schema": lambda: llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=opts),
             "object": lambda: llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=opts),
             "regex": lambda: llguidance.LLMatcher.grammar_from_regex(REGEX)}[kind]()
        m = llguidance.LLMatcher(tok, g, log_level=0)
        out[f"{name}_compile_ms"] = ms(t0)
        bits = torch.empty((vocab + 31) // 32, dtype=torch.int32)
        steps = []
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
            steps.append(ms(t0))
            assert m.consume_token(t), (name, m.get_error())
        out[f"{name}_mask_ms"] = statistics.median(steps)
    return out


def run_xgrammar(hf, vocab: int, cases: dict) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    out = {"tokenizer_ms": ms(t0)}
    for name, (kind, tokens) in cases.items():
        t0 = time.perf_counter()
        compiled = {"schema": lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                     separators=(", ", ": ")),
                    "object": lambda: compiler.compile_builtin_json_grammar(),
                    "regex": lambda: compiler.compile_regex(REGEX)}[kind]()
        m = xgr.GrammarMatcher(compiled)
        out[f"{name}_compile_ms"] = ms(t0)
        bits = xgr.allocate_token_bitmask(1, vocab)
        steps = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bits)
            steps.append(ms(t0))
            if not m.accept_token(t):
                out[f"{name}_note"] = "walk refused (whitespace rules differ)"
                break
        out[f"{name}_mask_ms"] = statistics.median(steps)
    return out


def _byte_vocabulary(hf) -> dict[bytes, list[int]]:
    """token bytes -> ids, GPT-2 byte-level tokens decoded to their bytes."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    dec = {c: b for b, c in bytes_to_unicode().items()}
    special = set(hf.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for s, i in hf.get_vocab().items():
        if i in special:
            continue
        try:
            out.setdefault(bytes(dec[c] for c in s), []).append(i)
        except KeyError:
            out.setdefault(s.encode(), []).append(i)
    return out


def run_outlines(hf, vocab: int, cases: dict) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    voc = Vocabulary(hf.eos_token_id, _byte_vocabulary(hf))
    out = {"tokenizer_ms": ms(t0)}
    for name, (kind, tokens) in cases.items():
        if kind == "object":
            out[f"{name}_note"] = "not expressible (a regex cannot match free-form, nested JSON)"
            continue
        regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?") if kind == "schema" else REGEX
        t0 = time.perf_counter()
        guide = Guide(Index(regex, voc))
        out[f"{name}_compile_ms"] = ms(t0)
        steps = []
        for t in tokens:
            t0 = time.perf_counter()
            allowed = guide.get_tokens()
            steps.append(ms(t0))
            if t not in allowed:
                out[f"{name}_note"] = "walk refused (its JSON regex differs)"
                break
            guide.advance(t)
        out[f"{name}_mask_ms"] = statistics.median(steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from engine.model_files import resolve_model_path
    from engine.tokenizer import Tokenizer

    print(f"load average before: {os.getloadavg()}", flush=True)
    tok = Tokenizer.from_model_path(resolve_model_path("smollm2"))
    vocab = 49152
    cases = {name: (kind, tok.encode(text)) for name, (kind, text) in CASES.items()}
    results = {}
    for lib, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar), ("outlines-core", run_outlines)):
        try:
            runs = [fn(tok.hf, vocab, cases) for _ in range(args.repeats)]
        except ImportError as err:
            results[lib] = {"error": f"not importable: {err}"}
            continue
        keys = runs[0].keys()
        results[lib] = {k: (statistics.median(r[k] for r in runs) if isinstance(runs[0][k], float) else runs[0][k])
                        for k in keys}
        print(lib, json.dumps(results[lib]), flush=True)
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
