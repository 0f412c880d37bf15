"""Configuration, model path and request validation errors."""
from pathlib import Path

import pytest

from engine.errors import RequestValidationError
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, Phase
from engine.sampling_params import SamplingParams
from engine.model_files import resolve_model_path
from pdserve.config import EngineSettings

from engine_testutil import cpu_settings


@pytest.mark.parametrize("kw", [dict(dtype="float64"), dict(block_size=0),
                                dict(num_kv_blocks=-1), dict(max_batch_size=0),
                                dict(max_num_tokens=0), dict(max_model_len=1),
                                dict(num_threads=0), dict(gpu_memory_utilization=1.5), dict(blok_size=4)])
def test_bad_settings_raise_naming_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        EngineSettings(**kw)


@pytest.mark.parametrize("kw,model,connector,match", [
    (dict(dtype="auto"), "smollm2", "disagg", "'auto' must be resolved"),
    (dict(device="auto"), "smollm2", "disagg", "engine.device must be 'cpu' or 'cuda:N'"),
    (dict(device="cuda"), "smollm2", "disagg", "engine.device must be 'cpu' or 'cuda:N'"),
    ({}, "", "disagg", "non-empty"),
    ({}, "smollm2", "p2p", "kv_connector"),
])
def test_the_engine_refuses_unresolved_settings_before_loading(kw, model, connector, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(cpu_settings(**kw), model, kv_connector=connector)


def test_resolve_model_path(tmp_path: Path, tiny_dir):
    assert resolve_model_path("smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(str(tiny_dir)) == tiny_dir
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="gguf"):
        resolve_model_path(str(tmp_path / "x.bin"))


def _bad_requests(max_len: int) -> list[EngineRequest]:
    sp = SamplingParams()
    return [
        EngineRequest("empty", [], sp),
        EngineRequest("long", [5] * max_len, sp),
        EngineRequest("oov", [5, 10 ** 9], sp),
        EngineRequest("gen-no-first", [5, 6], sp, phase=Phase.GENERATION_ONLY),
        EngineRequest("ctx-first", [5, 6], sp, phase=Phase.CONTEXT_ONLY, first_token_ids=[1]),
        EngineRequest("top_p", [5, 6], SamplingParams(top_p=0.0)),
        EngineRequest("temp", [5, 6], SamplingParams(temperature=-1)),
        EngineRequest("maxtok", [5, 6], SamplingParams(max_tokens=0)),
        EngineRequest("phase", [5, 6], sp, phase="bogus"),
    ]


def test_bad_requests_raise(tiny_engine):
    for req in _bad_requests(tiny_engine.max_model_len):
        with pytest.raises(RequestValidationError):
            tiny_engine.add_request(req)
    assert not tiny_engine.has_work()
    assert issubclass(RequestValidationError, ValueError)


def test_duplicate_request_id_rejected(tiny_engine):
    tiny_engine.add_request(EngineRequest("dup", [5, 6], SamplingParams(max_tokens=1)))
    with pytest.raises(RequestValidationError):
        tiny_engine.add_request(EngineRequest("dup", [5, 6], SamplingParams(max_tokens=1)))
    tiny_engine.abort_request("dup")
    tiny_engine.step()
    assert not tiny_engine.has_work()
