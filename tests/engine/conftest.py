"""Shared fixtures: SmolLM2 engine and HF reference (loaded once per session), tiny Llama dir."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP workers spin while waiting by default; on a shared, loaded machine that makes every op
# several times slower (SmolLM2 decode: 64 s vs 8 s for the same run). Must precede `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_files import resolve_model_path  # noqa: E402
from engine_testutil import cpu_settings  # noqa: E402

# The machine's 2 cores, shared by the pytest-xdist workers (PYTEST_XDIST_WORKER_COUNT in each).
torch.set_num_threads(max(1, 2 // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(scope="session")
def smollm2_engine() -> LLMEngine:
    return LLMEngine(cpu_settings(num_kv_blocks=512), "smollm2")  # float32: the HF reference's dtype


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> Path:
    """The suite's tiny random Llama (tests/conftest.py's ``tiny_model_dir``: seed 0, the SmolLM2
    tokenizer), without loading SmolLM2's weights for it (a tiny-only worker never needs them)."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_dir):
    def make(kv_connector: str = "disagg", **kw) -> LLMEngine:
        return LLMEngine(cpu_settings(**kw), str(tiny_dir), kv_connector=kv_connector)  # HF compares in fp32
    return make


@pytest.fixture(scope="session")
def tiny_engine(tiny_engine_factory) -> LLMEngine:
    return tiny_engine_factory(num_kv_blocks=256)


@pytest.fixture(scope="session")
def hf_smollm2():
    from transformers import AutoModelForCausalLM
    path = resolve_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    """family name -> random-weight HF checkpoint of tests/engine/families.py (SmolLM2 tokenizer)."""
    from families import FAMILIES, make_family_dir
    root = tmp_path_factory.mktemp("families")
    return {name: make_family_dir(root / name, name, tiny_dir) for name in FAMILIES}


@pytest.fixture(scope="session")
def hf_tokens(family_dirs) -> dict[str, list[list[int]]]:
    """family name -> HF transformers' greedy tokens for families.prompts() (N_NEW each)."""
    from families import N_NEW, hf_reference, prompts
    return {name: hf_reference(path, prompts(), N_NEW) for name, path in family_dirs.items()}
