"""Engine configuration: one frozen dataclass passed down whole."""
from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("float32", "bfloat16", "float16")
CPU_DEFAULT_KV_BLOCKS = 1024


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one LLMEngine.

    model: "smollm2" alias, path to a .gguf file, or a HF directory (config.json + *.safetensors).
    dtype: "float32" | "bfloat16" for weights, activations and the KV cache. Always concrete: a
        topology's ``engine.dtype: auto`` is resolved once by the server at start
        (pdserve.dtypes.resolve_dtype, from the CPU flags) and passed down resolved.
    device: "cpu" | "cuda:N" for weights, KV cache, attention metadata and sampling. Always
        concrete: ``engine.device: auto`` is resolved once by the server (pdserve.devices).
    block_size: tokens per KV block; num_kv_blocks: blocks in the paged KV cache; None = on a CPU
        the default 1024 (CPU_DEFAULT_KV_BLOCKS), on CUDA sized from free device memory
        (engine.kv_sizing, by gpu_memory_utilization).
    gpu_memory_utilization: the fraction (0, 1] of the GPU's total memory this engine may use for
        weights, activations and KV cache (vLLM's meaning: two servers on one GPU set 0.4 each).
    max_batch_size: max running sequences per step; max_num_tokens: token budget per step.
    max_model_len: longest sequence (prompt + output) in tokens; None = min(model max positions,
        num_kv_blocks * block_size).
    num_threads: torch.set_num_threads(num_threads) at engine start when set.
    kv_cache_file: back the KV cache by this file (shared memory another process maps).
    kv_cache_huge_pages: put an anonymous KV cache on transparent huge pages (engine.kv_memory):
        KV pulls between processes run ~2x faster than on 4 KiB pages.
    enable_prefix_caching: keep computed full KV blocks by content hash and start a request after
        its longest cached prefix (engine.block_manager); False = every prompt computed whole.
    served_model_name: the model id in block hashes (pdserve.block_hash; the servers use the
        topology's model.name, as the KV layout does); None = model.
    kv_connector: "disagg" (default: context_only requests park their blocks, generation_only ones
        load theirs, engine.kv_connector) or "none" (colocated requests only; the others are refused).
    pack_cpu_linears: on a CPU, run the linear layers on oneDNN with weights reordered once at load
        (engine.cpu_linear: 25-45% faster decode steps; fp32 rounding differs from F.linear's in the
        last bits); False = F.linear on the plain weights.

    Raises ValueError from __post_init__ when a value is out of range.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = CPU_DEFAULT_KV_BLOCKS
    gpu_memory_utilization: float = 0.9
    max_batch_size: int = 16
    max_num_tokens: int = 2048
    max_model_len: int | None = None
    num_threads: int | None = None
    kv_cache_file: str | None = None
    kv_cache_huge_pages: bool = True
    enable_prefix_caching: bool = True
    served_model_name: str | None = None
    kv_connector: str = "disagg"
    pack_cpu_linears: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("EngineConfig.model must be a non-empty string")
        if self.dtype == "auto":
            raise ValueError("EngineConfig.dtype 'auto' must be resolved before the engine is built "
                             "(pdserve.dtypes.resolve_dtype with the CPU flags)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda:"):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda:N' (resolved), got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("block_size", "num_kv_blocks", "max_batch_size", "max_num_tokens"):
            value = getattr(self, name)
            if name == "num_kv_blocks" and value is None:
                continue
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_connector not in ("disagg", "none"):
            raise ValueError(f"EngineConfig.kv_connector must be 'disagg' or 'none', got {self.kv_connector!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"EngineConfig.num_threads must be positive, got {self.num_threads}")
