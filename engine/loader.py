"""Load a model (LlamaModel, or Gemma3Model for Gemma 3) from a model spec (alias, .gguf file,
HF directory)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.gemma3 import Gemma3Model
from engine.gguf_file import load_gguf
from engine.hf_files import load_hf_dir
from engine.model import LlamaModel
from engine.model_files import is_gguf, resolve_model_path
from engine.tp import NO_TP, TPContext

log = logging.getLogger(__name__)


def load_model(spec: str, dtype: torch.dtype, tp: TPContext = NO_TP,
               device: str = "cpu", pack_cpu_linears: bool = False
               ) -> tuple[LlamaModel | Gemma3Model, Path]:
    """Return (model with weights in dtype on device, resolved path). Raises FileNotFoundError/ValueError.

    With TP every rank reads the whole checkpoint and keeps its shard. pack_cpu_linears: reorder
    the linear weights for oneDNN once (engine.cpu_linear; ignored off the CPU).
    """
    t0 = time.perf_counter()
    path = resolve_model_path(spec)
    config, state = load_gguf(path) if is_gguf(path) else load_hf_dir(path)
    if device != "cpu":  # move once, already in dtype: the model's own .to(dtype) are then no-ops
        state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                 for k, v in state.items()}
    cls = Gemma3Model if config.architecture == "gemma3" else LlamaModel
    model = cls(config, state, dtype, tp, pack_cpu_linears=pack_cpu_linears and device == "cpu")
    log.info("weights of %s loaded in %.2f s", path.name, time.perf_counter() - t0)
    return model, path
