"""Read a HF safetensors directory."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig, model_config_from_hf


def load_hf_dir(model_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return (ModelConfig, state dict as stored) from config.json + *.safetensors."""
    config = model_config_from_hf(model_dir)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return config, state
