"""What one ``pdserve bench`` run sends, built from the command line: independent requests
(:mod:`pdbench.datasets`) or multi-turn conversations (:mod:`pdbench.conversations`), plus the
unmeasured warm-up requests; and how a run of either kind is executed."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

import httpx

from .client import RequestOptions
from .conversations import Conversation, ConversationSpec, make_conversations, turn_sample
from .datasets import WORKLOADS, Sample, WorkloadSpec, make_workload
from .metrics import RequestRecord, per_turn_summary
from .multiturn import run_conversations
from .runner import RunSettings, run_load

ALL_WORKLOADS = WORKLOADS + ("multiturn",)


@dataclass
class Plan:
    """``samples`` (independent requests) or ``conversations`` (multiturn), never both."""

    workload: dict
    warmup: list[Sample]
    samples: list[Sample] | None = None
    conversations: list[Conversation] | None = None


@dataclass
class RunOutcome:
    """Records of one run (conversation-major for multiturn), its duration (s) and, for
    multiturn, the per-turn summary and each record's (conversation, turn) position."""

    records: list[RequestRecord]
    duration_s: float
    turns: list[dict] | None = None
    positions: list[tuple[int, int]] = field(default_factory=list)


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(name=args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                        num_prefixes=args.num_prefixes, max_input_len=args.max_input_len,
                        max_output_len=args.max_output_len, long_fraction=args.long_fraction,
                        long_input_len=args.long_input_len, long_output_len=args.long_output_len,
                        prompt_format=args.prompt_format, vocab_size=args.vocab_size, seed=args.seed,
                        prefix_order=args.prefix_order)


def conversations_from_args(args: argparse.Namespace) -> ConversationSpec:
    return ConversationSpec(num_conversations=args.num_conversations, num_turns=args.num_turns,
                            user_len=args.input_len, output_len=args.output_len,
                            system_len=args.system_prompt_len, seed=args.seed)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The requests of a run. Raises ValueError for bad workload arguments."""
    n_warm = max(0, args.num_warmups)
    if args.workload == "multiturn":
        spec = conversations_from_args(args)
        convs = make_conversations(spec)
        # Warm-up: first turns of conversations of another seed (they share no text with the measured ones).
        warm = make_conversations(ConversationSpec(**{**asdict(spec), "num_conversations": max(1, n_warm),
                                                      "num_turns": 1, "seed": spec.seed + 10_000}))
        return Plan({"name": "multiturn", **asdict(spec)}, [turn_sample(c, []) for c in warm][:n_warm],
                    conversations=convs)
    spec = workload_from_args(args)
    warm_spec = WorkloadSpec(**{**asdict(spec), "num_prompts": max(1, n_warm), "seed": spec.seed + 10_000})
    return Plan(asdict(spec), make_workload(warm_spec)[:n_warm], samples=make_workload(spec))


async def execute(plan: Plan, client: httpx.AsyncClient, opts: RequestOptions, settings: RunSettings,
                  percentiles: tuple[float, ...], desc: str) -> RunOutcome:
    """Run the plan's requests (or conversations) once with ``settings``."""
    if plan.conversations is None:
        records, duration = await run_load(client, plan.samples or [], opts, settings, desc=desc)
        return RunOutcome(records, duration)
    by_conv, duration = await run_conversations(client, plan.conversations, opts, settings, desc=desc)
    positions = [(c, t + 1) for c, recs in enumerate(by_conv) for t in range(len(recs))]
    return RunOutcome([r for recs in by_conv for r in recs], duration, per_turn_summary(by_conv, percentiles),
                      positions)
