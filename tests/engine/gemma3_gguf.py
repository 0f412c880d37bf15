"""Write a random-weight Gemma 3 checkpoint as a GGUF file the way llama.cpp's converter does, for
the GGUF loading tests: tensor names from gguf-py's own HF -> GGUF name map (an oracle
independent of engine/gguf_file.py's reverse map), every norm weight stored as 1 + w, no q/k row permutation
(Gemma's RoPE is the NeoX layout), `gemma3.*` metadata keys, and a byte-level tokenizer of 256
byte tokens plus <bos>/<eos> (tiny, so transformers reads the file fast).

ffn_down goes in as Q4_K (random blocks: the format decodes any bytes), gate/up as Q8_0, the rest
F32, so the file exercises the K-quant dequantization a Q4_K_M file needs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BOS, EOS = 256, 257
VOCAB = 258


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet (printable bytes map to themselves, the other 68 to
    U+0100 on, in byte order): the 256 tokens of a byte-level BPE without merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K data for a [rows, cols] tensor (cols % 256 == 0): uint8 [rows, cols/256*144]
    with small positive f16 scales d / dmin so values stay in about [-0.25, 0.5]."""
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((1,), 5e-4, np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((1,), 4e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def _add_metadata(writer, config, sliding_window: int) -> None:
    writer.add_name("tiny-gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([*byte_tokens(), "<bos>", "<eos>"])
    writer.add_token_types([1] * 256 + [3, 3])   # normal bytes, two control tokens
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)


def write_gemma3_gguf(path: Path, model, sliding_window: int) -> Path:
    """model: a transformers Gemma3ForCausalLM (fp32, vocab VOCAB, intermediate_size % 256 == 0,
    tied embeddings). Writes path and returns it."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    _add_metadata(writer, config, sliding_window)
    for i, (hf_name, t) in enumerate(model.state_dict().items()):
        if hf_name == "lm_head.weight":
            continue   # tied: llama.cpp writes no output.weight
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        w = t.detach().to(torch.float32).numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(name, w + 1)            # llama.cpp's Gemma converter adds the 1
        elif ".ffn_down." in name:
            # uint8 data with a raw_dtype: the writer reads the byte shape as the quant's
            writer.add_tensor(name, _q4_k(*w.shape, seed=i),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif ".ffn_gate." in name or ".ffn_up." in name:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_PIECES = ["\u2581", "t", "h", "e", "a", "n", "o", "r", "s", "i", "u", "w", "\u2581t", "he",
              "\u2581the", "an", "\u2581a", "\u2581an", "in", "on", "er", "\u2581o", "is", "\u2581is",
              "  ", "   "]


def write_spm_tokenizer_gguf(path: Path) -> Path:
    """A header-only `gemma3` GGUF whose tokenizer is SentencePiece-style (`tokenizer.ggml.model`
    "llama", as Gemma 3 files have it): <pad> <eos> <bos> <unk>, 256 byte-fallback tokens, a few
    pieces (multi-space ones spelled with real spaces, as llama.cpp stores Gemma's) and a
    user-defined <start_of_turn>; no merges (the builder derives them). Returns path."""
    import gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)),
              *SPM_PIECES, "<start_of_turn>"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(SPM_PIECES) + [4]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny-gemma3-spm")
    for add, value in ((writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 256),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 1)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
