"""`engine.dtype: auto`: bf16 where the CPU has native bf16, fp32 elsewhere; resolved once per
server; `pdserve config check` prints what it resolves to. The CPU flags are a parameter, so both
kinds of CPU are tested on whichever this machine is."""

from __future__ import annotations

import pytest

import orchestrator.cli as cli
from pdserve.config import TopologyError, parse_topology
from pdserve.dtypes import (describe_resolution, emulation_warning, has_native_bf16, read_cpu_flags,
                            resolve_dtype)

AVX2 = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})          # the AVX2-only host of 2026-12-01
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX2 | {"amx_tile", "amx_bf16"}
POOLS = {"ctx": {"servers": [{"port": 8001}]}, "gen": {"servers": [{"port": 8002}]}}


def test_read_cpu_flags_takes_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: x\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert read_cpu_flags(tmp_path / "absent") == frozenset()
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert read_cpu_flags(tmp_path / "arm") == frozenset()


@pytest.mark.parametrize("flags,auto", [(AVX2, "float32"), (AVX512_BF16, "bfloat16"), (AMX, "bfloat16"),
                                        (frozenset(), "float32")])
def test_auto_follows_native_bf16(flags, auto):
    assert resolve_dtype("auto", flags) == auto
    assert has_native_bf16(flags) is (auto == "bfloat16")
    for explicit in ("float32", "bfloat16"):  # an explicit dtype is never second-guessed
        assert resolve_dtype(explicit, flags) == explicit


def test_auto_on_a_gpu_is_bf16_and_bad_values_are_refused():
    assert resolve_dtype("auto", AVX2, device="cuda") == "bfloat16"
    assert emulation_warning("bfloat16", AVX2, device="cuda") is None
    assert resolve_dtype("float16", AVX2) == "float16"  # issue 12: fp16 accepted
    with pytest.raises(ValueError, match="engine.dtype must be one of auto, float32, bfloat16, float16; got 'float8'"):
        resolve_dtype("float8", AVX2)


def test_bf16_without_native_support_warns():
    warning = emulation_warning("bfloat16", AVX2)
    assert warning is not None and "emulated" in warning and "5-20x" in warning and "float32" in warning
    assert emulation_warning("bfloat16", AVX512_BF16) is None
    assert emulation_warning("float32", AVX2) is None


def test_topology_default_is_auto_and_a_server_resolves_it():
    t = parse_topology({"pools": POOLS})
    assert t.engine.dtype == "auto" and t.pool_engine("gen").dtype == "auto"
    cfg = t.server_config("gen", 0)
    assert cfg.with_resolved_dtype(AVX2).engine.dtype == "float32"
    assert cfg.with_resolved_dtype(AVX512_BF16).engine.dtype == "bfloat16"
    assert cfg.with_resolved_dtype(AVX2).engine.block_size == cfg.engine.block_size  # nothing else changes
    pinned = parse_topology({"engine": {"dtype": "bfloat16"}, "pools": POOLS}).server_config("ctx", 0)
    assert pinned.with_resolved_dtype(AVX2).engine.dtype == "bfloat16"


def test_pools_must_agree_on_the_dtype_setting():
    pools = {**POOLS, "gen": {"servers": [{"port": 8002}], "engine": {"dtype": "float32"}}}
    with pytest.raises(TopologyError, match="pools.gen.engine.dtype: ctx resolves to 'auto' and gen to 'float32'"):
        parse_topology({"pools": pools})
    both = {**POOLS, "ctx": {"servers": [{"port": 8001}], "engine": {"dtype": "float32"}}, "gen": pools["gen"]}
    assert parse_topology({"pools": both}).pool_engine("ctx").dtype == "float32"


@pytest.mark.parametrize("flags,resolved", [(AVX2, "float32"), (AVX512_BF16, "bfloat16")])
def test_config_check_prints_the_resolved_dtype(tmp_path, capsys, monkeypatch, flags, resolved):
    monkeypatch.setattr(cli, "read_cpu_flags", lambda: flags)
    path = tmp_path / "c.yaml"
    path.write_text("engine: {dtype: auto}\npools: {ctx: {servers: [{port: 8001}]}, gen: {servers: [{port: 8002}]}}\n")
    assert cli.main(["config", "check", "--no-files", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"#   ctx: engine.dtype auto resolves to {resolved} on this machine" in out
    assert f'ctx[0] http://127.0.0.1:8001 engine: {{"dtype": "{resolved}"' in out
    assert "dtype: auto" in out  # the file's own setting is printed as written


def test_describe_names_the_flag_and_warns_for_emulated_bf16():
    assert "native bf16 (amx_bf16)" in describe_resolution("auto", AMX)
    line = describe_resolution("bfloat16", AVX2)
    assert "resolves to bfloat16" in line and "no native bf16" in line and "warning: " in line and "emulated" in line
