"""A server resolves `engine.dtype` once at start and says so when bf16 would be emulated."""

from __future__ import annotations

import logging

import pytest

from executor.server_main import resolve_dtype_once
from executor.server_setup import make_engine
from pdserve.config import parse_topology
from tests.executor.engine_args import engine_args

AVX2 = frozenset({"avx", "avx2", "fma"})
BF16 = AVX2 | {"avx512_bf16"}


def _server(dtype: str):
    return parse_topology({"engine": {"dtype": dtype}, "pools": {"ctx": {"servers": [{"port": 8001}]},
                                                                 "gen": {"servers": [{"port": 8002}]}}}
                          ).server_config("gen", 0)


@pytest.mark.parametrize("setting,flags,resolved,warns", [
    ("auto", AVX2, "float32", False), ("auto", BF16, "bfloat16", False),
    ("bfloat16", AVX2, "bfloat16", True), ("bfloat16", BF16, "bfloat16", False), ("float32", AVX2, "float32", False),
])
def test_resolved_once_with_a_warning_for_emulated_bf16(caplog, setting, flags, resolved, warns):
    with caplog.at_level(logging.INFO, logger="pdserve.server"):
        cfg = resolve_dtype_once(_server(setting), flags)
    assert cfg.engine.dtype == resolved
    assert engine_args(cfg)["config"].dtype == resolved  # what the engine (and the KV layout) is built with
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) is warns, warnings
    if warns:
        assert warnings[0].startswith("gen[0]: engine.dtype bfloat16 is emulated on this CPU")


def test_an_unresolved_dtype_never_reaches_the_engine():
    with pytest.raises(ValueError, match="'auto' must be resolved"):
        make_engine(_server("auto"))  # refused before any weight is read
