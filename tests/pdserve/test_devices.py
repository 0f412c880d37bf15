"""engine.device resolution (pdserve.devices) and the server's one resolution of device then dtype."""
import pytest

from pdserve.config import EngineSettings, ServerConfig, KVTransferSettings, ModelSettings
from pdserve.devices import check_device_setting, resolve_device
from pdserve.dtypes import resolve_dtype


@pytest.mark.parametrize("setting,count,want", [
    ("auto", 0, "cpu"), ("auto", 2, "cuda:0"), ("cpu", 4, "cpu"),
    ("cuda", 1, "cuda:0"), ("cuda:1", 2, "cuda:1"),
])
def test_resolve_device(setting, count, want):
    assert resolve_device(setting, count) == want


@pytest.mark.parametrize("setting,count", [("cuda", 0), ("cuda:2", 2)])
def test_missing_cuda_device_names_the_allocation(setting, count):
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        resolve_device(setting, count)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "mps", ""])
def test_bad_device_setting(bad):
    with pytest.raises(ValueError, match="engine.device"):
        check_device_setting(bad)
    with pytest.raises(ValueError):
        EngineSettings(device=bad)


def test_dtype_auto_is_bf16_on_cuda_and_follows_cpu_flags_on_cpu():
    assert resolve_dtype("auto", frozenset(), "cuda:0") == "bfloat16"
    assert resolve_dtype("auto", frozenset(), "cpu") == "float32"
    assert resolve_dtype("float16", frozenset(), "cuda:0") == "float16"


def _server(**engine) -> ServerConfig:
    return ServerConfig(role="ctx", index=0, model=ModelSettings(), engine=EngineSettings(**engine),
                        kv_transfer=KVTransferSettings(), host="127.0.0.1", port=1, kv_port=2)


def test_server_resolves_device_before_dtype():
    from executor.server_main import resolve_dtype_once

    on_gpu = resolve_dtype_once(_server(), frozenset(), num_cuda_devices=1)
    assert (on_gpu.engine.device, on_gpu.engine.dtype) == ("cuda:0", "bfloat16")
    on_cpu = resolve_dtype_once(_server(), frozenset(), num_cuda_devices=0)
    assert (on_cpu.engine.device, on_cpu.engine.dtype) == ("cpu", "float32")
    with pytest.raises(ValueError, match="needs CUDA device 0"):
        resolve_dtype_once(_server(device="cuda"), frozenset(), num_cuda_devices=0)


def test_tp_ranks_get_one_gpu_each_and_nccl():
    from pdserve.devices import tp_backend, tp_rank_device

    assert [tp_rank_device("cuda:1", r) for r in range(3)] == ["cuda:1", "cuda:2", "cuda:3"]
    assert tp_rank_device("cpu", 2) == "cpu"
    assert (tp_backend("cuda:0"), tp_backend("cpu")) == ("nccl", "gloo")


def test_no_driver_means_no_cuda_device_and_no_torch_import(tmp_path):
    """Without the NVIDIA driver's nodes the answer is 0 at once: a CPU server resolves its device
    before it launches its ranks, and importing torch there would delay them by seconds."""
    import subprocess
    import sys

    from pdserve.devices import visible_cuda_devices

    assert visible_cuda_devices((tmp_path / "nvidiactl", tmp_path / "dxg")) == 0
    code = ("import sys, pathlib; from pdserve.devices import visible_cuda_devices; "
            f"n = visible_cuda_devices((pathlib.Path({str(tmp_path / 'none')!r}),)); "
            "assert n == 0 and 'torch' not in sys.modules, (n, 'torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_server_launches_its_ranks_before_it_imports_torch():
    """``python -m ctx_worker`` imports only light modules before :func:`launch_ranks` (the ranks'
    start-up then overlaps the frontend's imports of torch and the HTTP stack)."""
    import subprocess
    import sys

    code = ("import sys; import executor.server_main as m; import executor.proxy; "
            "heavy = [n for n in ('torch', 'fastapi', 'uvicorn', 'transformers', 'engine') if n in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
