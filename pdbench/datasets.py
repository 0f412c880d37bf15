"""Synthetic workloads: lists of :class:`Sample` (prompt + planned lengths), all seeded.

- ``random``: input/output lengths uniform in ``[len·(1−r), len·(1+r)]`` (``r`` = range ratio;
  0 = fixed lengths).
- ``sharegpt``: a ShareGPT-like length distribution without the data set: log-normal input and
  output lengths (long right tail, median ``--input-len`` / ``--output-len``), clipped to
  ``[4, --max-input-len]`` and ``[1, --max-output-len]``.
- ``prefix``: ``--num-prefixes`` shared system prefixes of ``--prefix-len`` tokens, each request
  one of them followed by its own random suffix of ``--input-len`` tokens. ``--prefix-order
  cycle`` takes them round robin (0, 1, 2, …); ``shuffle`` takes each round of ``--num-prefixes``
  requests in a seeded random order (every prefix once per round: the order a round-robin router
  must not partition by accident).
- ``system-prompt``: the same lengths as ``prefix`` (``--num-prefixes`` shared prompts of
  ``--prefix-len`` tokens, each request one of them followed by its own ``--input-len`` tokens),
  shaped like chat traffic: on the chat endpoint the shared part is the system message and the
  rest the user message (with ids, or on completions, the two are concatenated). The issue-10
  experiment: ``--prefix-len 1800 --input-len 200 --num-prefixes 1``, 2,000-token prompts sharing
  their first 1,800 tokens.
- ``mixed``: a fraction ``--long-fraction`` of long prompts (``--long-input-len`` in,
  ``--long-output-len`` out) among short ones (``--input-len`` in, ``--output-len`` out), shuffled:
  long prefills land while short requests decode (the interference case of disaggregation).

Prompts are token-id lists (sent as ``prompt: [ids]`` to ``/v1/completions``: exact lengths) or
text (``--prompt-format text``: words from a fixed list, about one token each; the exact count
comes back in ``usage.prompt_tokens``). Chat endpoints need text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("random", "sharegpt", "prefix", "system-prompt", "mixed")
# Ordinary English words that GPT-2 style BPE vocabularies keep as one token (with a leading space).
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or "
         "has had not but first one their its new after who they have her she two been other when there "
         "all during into school time may years more most only over city some world would where later "
         "up such used many can state about national out known university united then made").split()
PREFIX_ORDERS = ("cycle", "shuffle")
LOW_TOKEN_ID = 256  # skip byte-level and special ids at the bottom of the vocabulary


@dataclass
class Sample:
    """One request: ``prompt`` (completions), ``messages`` (chat; None = one user message of ``prompt``)."""

    prompt: list[int] | str
    prompt_len: int   # planned (exact for ids, approximate for text)
    output_len: int
    messages: list[dict] | None = None


@dataclass
class WorkloadSpec:
    name: str = "random"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 4
    max_input_len: int = 1024
    max_output_len: int = 512
    long_fraction: float = 0.25
    long_input_len: int = 1024
    long_output_len: int = 8
    prompt_format: str = "ids"   # "ids" or "text"
    prefix_order: str = "cycle"  # "cycle" or "shuffle" (prefix, system-prompt)
    vocab_size: int = 32000
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the bad field."""
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS)}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError("prompt_format must be 'ids' or 'text'")
        if self.prefix_order not in PREFIX_ORDERS:
            raise ValueError(f"prefix_order must be one of {', '.join(PREFIX_ORDERS)}")
        for key in ("num_prompts", "input_len", "output_len", "max_input_len", "max_output_len", "num_prefixes",
                    "long_input_len", "long_output_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")
        if self.prefix_len < 0:
            raise ValueError("prefix_len must be >= 0")
        if self.name == "system-prompt" and self.prefix_len < 1:
            raise ValueError("prefix_len must be >= 1 for the system-prompt workload")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must be in [0, 1]")
        if self.vocab_size <= LOW_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must be > {LOW_TOKEN_ID + 1}")


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(n)]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _ranged(rng: random.Random, n: int, ratio: float) -> int:
    lo, hi = max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))
    return rng.randint(lo, hi)


def _lognormal_len(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def _prefix_sequence(rng: random.Random, spec: WorkloadSpec) -> list[int]:
    """Which prefix each of the ``num_prompts`` requests uses (see ``prefix_order``)."""
    order: list[int] = []
    while len(order) < spec.num_prompts:
        round_ = list(range(spec.num_prefixes))
        if spec.prefix_order == "shuffle":
            rng.shuffle(round_)
        order += round_
    return order[:spec.num_prompts]


def _system_chat(system: str, prompt: str) -> list[dict]:
    """Chat messages of a ``system-prompt`` sample: the shared prefix as the system message."""
    user = prompt[len(system):].lstrip() if system else prompt
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def make_workload(spec: WorkloadSpec) -> list[Sample]:
    """``spec.num_prompts`` samples, reproducible from ``spec.seed``. Raises ValueError."""
    spec.check()
    rng = random.Random(spec.seed)

    def prompt(n: int, prefix: list[int] | str | None = None) -> list[int] | str:
        if spec.prompt_format == "text":
            body = _text(rng, n)
            return f"{prefix} {body}" if prefix else body
        return (list(prefix) if prefix else []) + _ids(rng, n, spec.vocab_size)

    samples: list[Sample] = []
    if spec.name == "random":
        for _ in range(spec.num_prompts):
            n_in = _ranged(rng, spec.input_len, spec.range_ratio)
            samples.append(Sample(prompt(n_in), n_in, _ranged(rng, spec.output_len, spec.range_ratio)))
    elif spec.name == "sharegpt":
        # ShareGPT conversations: prompt lengths ~ log-normal with sigma ~1.0, answers ~0.8.
        for _ in range(spec.num_prompts):
            n_in = _lognormal_len(rng, spec.input_len, 1.0, 4, spec.max_input_len)
            n_out = _lognormal_len(rng, spec.output_len, 0.8, 1, spec.max_output_len)
            samples.append(Sample(prompt(n_in), n_in, n_out))
    elif spec.name in ("prefix", "system-prompt"):
        prefixes = [prompt(spec.prefix_len) for _ in range(spec.num_prefixes)]
        for i in _prefix_sequence(rng, spec):
            n_in = _ranged(rng, spec.input_len, spec.range_ratio)
            shared = prefixes[i]
            sample = Sample(prompt(n_in, shared), spec.prefix_len + n_in, _ranged(rng, spec.output_len, spec.range_ratio))
            if spec.name == "system-prompt" and spec.prompt_format == "text":
                sample.messages = _system_chat(shared, sample.prompt)
            samples.append(sample)
    else:  # mixed
        n_long = round(spec.num_prompts * spec.long_fraction)
        kinds = [True] * n_long + [False] * (spec.num_prompts - n_long)
        rng.shuffle(kinds)
        for long in kinds:
            n_in = spec.long_input_len if long else spec.input_len
            n_out = spec.long_output_len if long else spec.output_len
            samples.append(Sample(prompt(n_in), n_in, n_out))
    return samples
