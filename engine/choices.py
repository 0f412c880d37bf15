"""n > 1 (OpenAI's ``n``): one prefill, then n decodes that share the prompt's KV blocks.

A request with n choices runs as one sequence until its prompt's KV is computed: colocated and
on a ctx server, its last prefill chunk, which samples n first tokens from the one logits row
(choice i with choice index i); on a gen server, when its KV pull landed (the ctx server sampled
the n first tokens). Then it forks (:func:`fork`): the sequence goes on as choice 0 and choices
1..n-1 are new sequences with the same prompt.

Blocks: every full block of the prompt is shared (one more reference each,
:meth:`engine.block_manager.BlockManager.fork`) and stays read-only, since a choice only writes
positions past the prompt. A partial last block (prompt length not a multiple of block_size) is
where every choice writes its first token next, so each choice 1..n-1 gets a fresh block holding a
copy of its KV (copy-on-write, done at the fork). When no block is free for that copy, the choice
starts as a preempted sequence does: no blocks, first in the queue; it recomputes its tokens
(after the prefix cache's hit, when caching is on).

ctx server (CONTEXT_ONLY): nothing is decoded there, so choices 1..n-1 hold no blocks; the
request's blocks stay with choice 0 and are parked once, if any choice goes on (``keep_blocks``).

Structured output: the n first tokens are drawn from the one row under the request's one grammar
mask (no token consumed yet); each choice then has its own matcher (:meth:`Sequence.child` forks
it), which consumes that choice's tokens only.

Drain ``move_kv`` (:meth:`engine.llm_engine.LLMEngine.move_out`): a movable n > 1 request moves
choice by choice once every unfinished choice sits at a decode step boundary: each finishes with
``moved``, its own block table parked under ``"<request id>-c<i>"`` (the shared prompt blocks keep
one reference per choice, so each release frees what that choice held and the last one frees the
prompt). When a choice cannot be parked, every unfinished choice finishes with ``handed_back``
instead, its blocks freed (the caller prefills each choice again elsewhere).

Randomness: choice i draws with choice index i (:mod:`engine.sampler`), so seeded choices are
reproducible and differ from each other, and choice 0 of n draws exactly what the same request
with n = 1 draws (the contract: ``docs/architecture.md``, "n > 1").
"""
from __future__ import annotations

from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.request import RequestOutput
from engine.sequence import Sequence


def fork(parent: Sequence, bm: BlockManager, copy_block: Callable[[int, int], None],
         make_detokenizer: Callable[[], IncrementalDetokenizer], with_blocks: bool) -> list[Sequence]:
    """Split ``parent`` (``parent.n`` > 1, prompt computed, no output token yet) into its choices.

    Returns [parent (choice 0, its blocks unchanged), choice 1, ..., choice n-1]. With
    ``with_blocks`` each new choice shares the full prompt blocks and gets a copy of the partial
    last one (``copy_block(src, dst)`` copies one block's KV, every layer); a choice left with
    ``num_computed`` 0 found no free block and must be queued to recompute. Without
    ``with_blocks`` (ctx) the new choices hold no blocks.
    """
    n, parent.n = parent.n, 1
    family = [parent]
    for i in range(1, n):
        child = parent.child(i, make_detokenizer())
        if with_blocks:
            table = _fork_blocks(bm, parent.block_ids, parent.num_computed, copy_block)
            if table is None:
                child.num_computed, child.num_offered_blocks = 0, 0
            else:
                child.block_ids = table
        family.append(child)
    return family


def _fork_blocks(bm: BlockManager, parent_blocks: list[int], num_tokens: int,
                 copy_block: Callable[[int, int], None]) -> list[int] | None:
    """A block table for a choice holding the KV of ``num_tokens`` tokens: the parent's full blocks
    shared, its partial last block copied; None when the copy finds no free block."""
    full, partial = divmod(num_tokens, bm.block_size)
    if partial and not bm.can_allocate(1):
        return None
    table = bm.fork(parent_blocks[:full])
    if partial:
        dst = bm.allocate(1)[0]
        copy_block(parent_blocks[full], dst)
        table.append(dst)
    return table


class Families:
    """The choices of each forked request until every one finished (request id -> sequences in
    choice order), and the rule for their outputs: a forked request's output is ``finished`` only
    when it is the request's last (every choice finished)."""

    def __init__(self) -> None:
        self._members: dict[str, list[Sequence]] = {}

    def add(self, family: list[Sequence]) -> None:
        self._members[family[0].request_id] = family

    def members(self, request_id: str) -> list[Sequence] | None:
        return self._members.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Set ``finished`` on the outputs of forked requests (in place; returns ``outputs``).

        A request whose choices all finished gets ``finished`` on its last output of this step, which
        also carries the parked block ids (ctx: choice 0's blocks), and leaves the families. A moved
        choice's output keeps its own parked block ids (each choice is parked on its own)."""
        last: dict[str, int] = {}
        for i, out in enumerate(outputs):
            if out.request_id in self._members:
                last[out.request_id] = i
                out.finished = False
        for rid, i in last.items():
            family = self._members[rid]
            if not all(m.finished for m in family):
                continue
            outputs[i].finished = True
            if outputs[i].moved is None:  # ctx hand-off: choice 0's blocks go with the last output
                parked = next((o.parked_block_ids for o in outputs
                               if o.request_id == rid and o.parked_block_ids is not None), None)
                for o in outputs:
                    if o.request_id == rid:
                        o.parked_block_ids = None
                outputs[i].parked_block_ids = parked
            del self._members[rid]
        return outputs
