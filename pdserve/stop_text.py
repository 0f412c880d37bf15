"""Stop-string text rules shared by the engine and the orchestrator's relay (torch-free)."""
from __future__ import annotations


def held_back_len(text: str, stops: list[str]) -> int:
    """Length (characters) of the longest suffix of ``text`` that is a proper prefix of a stop string.

    Such a tail may still become a stop string with the next token, so neither the engine's
    detokenized stream nor the orchestrator's relay sends it until the next token decides."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
