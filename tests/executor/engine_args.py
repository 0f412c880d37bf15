"""What ``executor.server_setup.make_engine`` hands ``LLMEngine``, recorded without loading a model."""

from __future__ import annotations

import inspect
from unittest import mock


def engine_args(cfg, **kw) -> dict:
    """The bound arguments of the ``LLMEngine(...)`` call that ``make_engine(cfg, **kw)`` makes
    (defaults applied; ``config`` is the EngineSettings instance itself). Nothing is loaded."""
    from engine.llm_engine import LLMEngine
    from executor.server_setup import make_engine

    signature = inspect.signature(LLMEngine.__init__)
    seen: dict = {}

    def record(self, *args, **kwargs) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        seen.update(bound.arguments)
        del seen["self"]

    with mock.patch.object(LLMEngine, "__init__", record):
        make_engine(cfg, **kw)
    return seen
