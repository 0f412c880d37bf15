"""What the engine asks of its configuration, :class:`pdserve.config.EngineSettings`.

The engine has no configuration class of its own: ``LLMEngine`` takes the server's
``EngineSettings`` (the topology's ``engine:`` section, the pool's overrides applied) whole, with
``dtype`` and ``device`` resolved by the server at start, and keeps it as ``engine.config``.
"""
from __future__ import annotations

from pdserve.config import EngineSettings
from pdserve.dtypes import CONCRETE_DTYPES

# engine.num_kv_blocks unset on a CPU (engine.kv_sizing sizes it from free memory on CUDA)
CPU_DEFAULT_KV_BLOCKS = 1024
KV_CONNECTORS = ("disagg", "none")


def check_engine_config(settings: EngineSettings, model: str, kv_connector: str) -> None:
    """Refuse what the engine cannot be built with, before any weight is read.

    settings: ``dtype`` must be concrete (``auto`` is resolved by the server,
    pdserve.dtypes.resolve_dtype with the CPU flags) and ``device`` ``cpu`` or ``cuda:N``
    (pdserve.devices.resolve_device). model: a non-empty path or alias. kv_connector: one of
    KV_CONNECTORS (engine.kv_connector.make_connector). Raises ValueError naming the field.
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"the engine's model must be a non-empty string, got {model!r}")
    if settings.dtype not in CONCRETE_DTYPES:
        raise ValueError(f"engine.dtype {settings.dtype!r} must be resolved before the engine is built "
                         "(pdserve.dtypes.resolve_dtype with the CPU flags)")
    if settings.device != "cpu" and not settings.device.startswith("cuda:"):
        raise ValueError(f"engine.device must be 'cpu' or 'cuda:N' (resolved: pdserve.devices.resolve_device), "
                         f"got {settings.device!r}")
    if kv_connector not in KV_CONNECTORS:
        raise ValueError(f"the engine's kv_connector must be one of {KV_CONNECTORS}, got {kv_connector!r}")
