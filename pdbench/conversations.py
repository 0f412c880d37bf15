"""Multi-turn conversations for ``pdserve bench --workload multiturn``: the seeded user side and
how each turn's request is built from the history. Pure functions, no I/O.

A conversation has ``num_turns`` user messages of about ``user_len`` words (~1 token each, from
:data:`pdbench.datasets.WORDS`) and, optionally, a system prompt of ``system_len`` words shared by
every conversation (0 = none). Turn *k* (1-based) sends the whole history: the system prompt, user
messages 1..k and the answers the server actually gave to turns 1..k−1, so turn *k*'s prompt starts
with turn *k−1*'s prompt (what a prefix cache can reuse). Each conversation draws its messages
from its own generator seeded by ``(seed, conversation index)``, so a conversation's text does not
depend on how many others run or in what order they finish.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .datasets import WORDS, Sample


@dataclass
class ConversationSpec:
    """Shape of a multiturn workload (lengths in words ≈ tokens, answers in tokens)."""

    num_conversations: int = 8
    num_turns: int = 4
    user_len: int = 50
    output_len: int = 32
    system_len: int = 0
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the bad field."""
        for key in ("num_conversations", "num_turns", "user_len", "output_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1")
        if self.system_len < 0:
            raise ValueError("system_len must be >= 0")


@dataclass
class Conversation:
    """The user side of one conversation: ``system`` ('' = no system message) and one message per turn."""

    index: int
    system: str
    user_messages: list[str]
    output_len: int


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_conversations(spec: ConversationSpec) -> list[Conversation]:
    """``spec.num_conversations`` conversations, reproducible from ``spec.seed``. Raises ValueError."""
    spec.check()
    system = _words(random.Random(f"{spec.seed}:system"), spec.system_len) if spec.system_len else ""
    convs = []
    for i in range(spec.num_conversations):
        rng = random.Random(f"{spec.seed}:conversation:{i}")
        # A distinct opening per conversation: two conversations never share more than the system prompt.
        users = [f"Conversation {i} turn {t + 1}: " + _words(rng, spec.user_len) for t in range(spec.num_turns)]
        convs.append(Conversation(i, system, users, spec.output_len))
    return convs


def turn_messages(conv: Conversation, answers: list[str]) -> list[dict]:
    """Chat messages of turn ``len(answers) + 1``: the history with the server's ``answers``.

    Raises:
        ValueError: more answers than the conversation has turns.
    """
    turn = len(answers) + 1
    if turn > len(conv.user_messages):
        raise ValueError(f"conversation {conv.index} has {len(conv.user_messages)} turns, not {turn}")
    msgs = [{"role": "system", "content": conv.system}] if conv.system else []
    for user, answer in zip(conv.user_messages, answers):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    msgs.append({"role": "user", "content": conv.user_messages[turn - 1]})
    return msgs


def transcript(messages: list[dict]) -> str:
    """A plain-text prompt of ``messages`` for ``/v1/completions`` (no chat template there):
    ``"System: …\\nUser: …\\nAssistant: …\\n…User: …\\nAssistant:"``. Each turn's transcript starts
    with the previous turn's, as the chat messages do."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def turn_sample(conv: Conversation, answers: list[str]) -> Sample:
    """The request of the next turn as a :class:`Sample` (``messages`` for chat, ``prompt`` for
    completions; ``prompt_len`` is a word count, the exact one comes back in ``usage``)."""
    msgs = turn_messages(conv, answers)
    text = transcript(msgs)
    return Sample(prompt=text, prompt_len=len(text.split()), output_len=conv.output_len, messages=msgs)
