"""Load a model (LlamaModel, or Gemma3Model for Gemma 3) from a model spec (alias, .gguf file,
HF directory)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.cpu_ops import TORCH_OPS, select_ops
from engine.gemma3 import Gemma3Model
from engine.gguf_file import load_gguf
from engine.hf_files import load_hf_dir
from engine.model import LlamaModel
from engine.model_files import is_gguf, resolve_model_path
from engine.tp import NO_TP, TPContext

log = logging.getLogger(__name__)


def load_model(spec: str, dtype: torch.dtype, tp: TPContext = NO_TP,
               device: str = "cpu", pack_cpu_linears: bool = False, cpu_kernels: str = "off"
               ) -> tuple[LlamaModel | Gemma3Model, Path]:
    """Return (model with weights in dtype on device, resolved path). Raises FileNotFoundError/ValueError.

    With TP every rank reads the whole checkpoint and keeps its shard. pack_cpu_linears: reorder
    the linear weights for oneDNN once (engine.cpu_linear; ignored off the CPU). cpu_kernels:
    engine.cpu_kernels ("auto" | "on" | "off", engine.cpu_ops.select_ops; Llama-family models
    only, Gemma 3 runs ATen ops). Raises RuntimeError with "on" when the kernels cannot be used.
    """
    t0 = time.perf_counter()
    path = resolve_model_path(spec)
    config, state = load_gguf(path) if is_gguf(path) else load_hf_dir(path)
    if device != "cpu":  # move once, already in dtype: the model's own .to(dtype) are then no-ops
        state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                 for k, v in state.items()}
    pack = pack_cpu_linears and device == "cpu"
    if config.architecture == "gemma3":
        model = Gemma3Model(config, state, dtype, tp, pack_cpu_linears=pack)
    else:
        model = LlamaModel(config, state, dtype, tp, pack_cpu_linears=pack,
                           ops=select_ops(cpu_kernels, dtype, device))
    log.info("decoder ops of %s: %s", path.name, getattr(model, "ops", TORCH_OPS).name)
    log.info("weights of %s loaded in %.2f s", path.name, time.perf_counter() - t0)
    return model, path
