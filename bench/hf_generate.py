"""Hugging Face transformers ``generate`` baseline: output tokens/s of SmolLM2 on this CPU.

    taskset -c 0,1 python bench/hf_generate.py --threads 2 --batch 8 --input-len 128 --output-len 128

Greedy, exactly ``--output-len`` new tokens per sequence (``min_new_tokens``), prompts of random
token ids drawn like ``pdserve bench --workload random`` (same seed → same ids). Prints one JSON
line per repeat: ``{"batch", "seconds", "output_tokens", "tok_s"}`` (wall time of ``generate``,
prefill included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_files import resolve_model_path
    from pdbench.datasets import WorkloadSpec, make_workload

    torch.set_num_threads(args.threads)
    gguf = Path(resolve_model_path("smollm2"))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, args.dtype))
    model.eval()
    samples = make_workload(WorkloadSpec(name="random", num_prompts=args.batch, input_len=args.input_len,
                                         output_len=args.output_len, vocab_size=args.vocab_size))
    ids = torch.tensor([s.prompt for s in samples])
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
              pad_token_id=2, eos_token_id=2)
    with torch.inference_mode():
        model.generate(ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=2)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kw)
            dt = time.perf_counter() - t0
            n = (out.shape[1] - ids.shape[1]) * out.shape[0]
            print(json.dumps({"batch": args.batch, "seconds": dt, "output_tokens": n, "tok_s": n / dt}), flush=True)


if __name__ == "__main__":
    main()
