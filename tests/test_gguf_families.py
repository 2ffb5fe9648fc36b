"""GGUF import of the non-Llama families: a tiny `transformers` checkpoint is written as a GGUF
the way llama.cpp's converter writes it (its tensor names, Gemma's norms stored as 1 + w,
GPT-NeoX's fused qkv regrouped as [q; k; v], some weights quantized), imported back, and the
imported checkpoint must compute what the original computes in `transformers`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from families import load_reference, randomize, reference_logits
from safetensors import safe_open
from tiny import make_tokenizer

from aotgen.checkpoint.gguf import import_gguf
from aotgen.checkpoint.hf import CheckpointError
from aotgen.kernels import gguf_blocks
from aotgen.runtime.tokenizer import Tokenizer

pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=256
)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, num_key_value_heads=2)),
    "qwen3": (
        "Qwen3Config",
        dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    # llama.cpp's Gemma 3: every 6th layer global, local RoPE base 10000, scale head_dim ** -0.5.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            tie_word_embeddings=True,
        ),
    ),
    "gptneox": (
        "GPTNeoXConfig",
        dict(num_hidden_layers=2, rotary_pct=0.5, use_parallel_residual=True),
    ),
}
# HF module name → llama.cpp's (gguf-py tensor_mapping.py), per architecture.
LAYER_NAMES = {
    "llama": {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
    "gptneox": {
        "input_layernorm": "attn_norm",
        "attention.query_key_value": "attn_qkv",
        "attention.dense": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.dense_h_to_4h": "ffn_up",
        "mlp.dense_4h_to_h": "ffn_down",
    },
}
GEMMA_NAMES = {
    **LAYER_NAMES["llama"],
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "gpt_neox.embed_in": "token_embd",
    "gpt_neox.final_layer_norm": "output_norm",
    "embed_out": "output",
}
TEXTS = ["Hello world, the capital of France is Paris.", "  two  spaces\nand 12345 digits ✓"]


def _checkpoint(out: Path, arch: str, **sizes: Any) -> Path:
    import transformers

    out.mkdir(parents=True)
    tok = make_tokenizer(out)
    cls_name, kwargs = CONFIGS[arch]
    config = getattr(transformers, cls_name)(
        **{**BASE, **kwargs, **sizes},
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<|im_start|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, gemma=arch == "gemma3")
    model.save_pretrained(out)
    return out


def _gguf_name(arch: str, hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[module]}.{kind}"
    parts = module.split(".")  # model.layers.I.rest or gpt_neox.layers.I.rest
    i, rest = parts[2], ".".join(parts[3:])
    names = {"gemma3": GEMMA_NAMES, "gptneox": LAYER_NAMES["gptneox"]}.get(
        arch, LAYER_NAMES["llama"]
    )
    return f"blk.{i}.{names[rest]}.{kind}"


def _converted(arch: str, hf: str, w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py stores for an HF tensor."""
    if arch == "gemma3" and hf.endswith("norm.weight"):
        return w + np.float32(1.0)
    if arch == "gptneox" and "query_key_value" in hf:
        rest = w.shape[1:]
        return np.ascontiguousarray(
            w.reshape(heads, 3, -1, *rest).swapaxes(0, 1).reshape(w.shape[0], *rest)
        )
    return w


def _blocks(stored: np.ndarray, qtype: str, seed: int) -> np.ndarray:
    """gguf's quantizer where it has one for `qtype`; else (k-quants) random blocks scaled
    to weights of about the checkpoint's size."""
    t = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(stored, t)
    except NotImplementedError:
        q = gguf_blocks.QTYPES[qtype]
        return gguf_blocks.random_blocks(q, *stored.shape, seed=seed, scale=3e-4)


def _write_gguf(
    ckpt: Path, path: Path, arch: str, quantize: bool = True, qtypes: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The checkpoint as llama.cpp would convert it; returns the HF tensors written. Half the
    matrices are Q8_0, or with `qtypes` every matrix takes the next of them its rows fit."""
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "gptneox":
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        rope = cfg.get("rope_parameters") or {}
        pct = cfg.get("rotary_pct") or rope["partial_rotary_factor"]
        w.add_rope_dimension_count(int(pct * head_dim))
        w.add_rope_freq_base(cfg.get("rotary_emb_base") or rope.get("rope_theta", 10000.0))
        w.add_parallel_residual(cfg["use_parallel_residual"])
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        theta = cfg.get("rope_theta") or cfg["rope_parameters"].get("rope_theta")
        if arch == "gemma3":
            theta = cfg["rope_parameters"]["full_attention"]["rope_theta"]
            w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_freq_base(theta)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, t) for t, i in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for _, i in vocab]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    written: dict[str, np.ndarray] = {}
    with safe_open(ckpt / "model.safetensors", "np") as f:
        for n, hf in enumerate(sorted(f.keys())):
            x = f.get_tensor(hf).astype(np.float32)
            written[hf] = x
            stored = _converted(arch, hf, x, cfg["num_attention_heads"])
            blocks = x.ndim == 2 and x.shape[1]
            fits = [t for t in qtypes if blocks and blocks % gguf_blocks.QTYPES[t].block == 0]
            if not qtypes and quantize and x.ndim == 2 and x.shape[1] % 32 == 0 and n % 2 == 0:
                fits = ["Q8_0"]
            if fits:
                qtype = gguf.GGMLQuantizationType[fits[n % len(fits)]]
                q = _blocks(stored, qtype.name, seed=n)
                back = gguf.quants.dequantize(q, qtype)
                if arch == "gptneox" and "query_key_value" in hf:  # [q; k; v] → per head
                    heads = cfg["num_attention_heads"]
                    back = back.reshape(3, heads, -1, back.shape[1]).swapaxes(0, 1)
                written[hf] = back.reshape(x.shape)  # what the importer must give back
                w.add_tensor(_gguf_name(arch, hf), q, raw_shape=q.shape, raw_dtype=qtype)
            else:
                w.add_tensor(_gguf_name(arch, hf), stored)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_family_gguf_imports_to_the_same_model(tmp_path: Path, arch: str) -> None:
    ckpt = _checkpoint(tmp_path / "hf", arch)
    _write_gguf(ckpt, tmp_path / "m.gguf", arch, quantize=False)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    with (
        safe_open(ckpt / "model.safetensors", "np") as f,
        safe_open(out / "model.safetensors", "np") as g,
    ):
        assert set(g.keys()) == set(f.keys())
        for name in f.keys():
            np.testing.assert_allclose(g.get_tensor(name), f.get_tensor(name), atol=1e-6)
    ids = Tokenizer.from_dir(ckpt).encode(TEXTS[0])
    ref = reference_logits(load_reference(ckpt), ids)
    got = reference_logits(load_reference(out), ids)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    new, old = Tokenizer.from_dir(out), Tokenizer.from_dir(ckpt)
    for text in TEXTS:
        assert new.encode(text) == old.encode(text)


@pytest.mark.parametrize("arch", ["gemma3", "gptneox"])
def test_quantized_blocks_dequantize(tmp_path: Path, arch: str) -> None:
    """Q8_0 blocks on half the matrices; the importer gives back their dequantized values."""
    ckpt = _checkpoint(tmp_path / "hf", arch)
    written = _write_gguf(ckpt, tmp_path / "m.gguf", arch)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    with safe_open(out / "model.safetensors", "np") as g:
        for name, want in written.items():
            np.testing.assert_allclose(g.get_tensor(name), want, atol=1e-6, err_msg=name)


def test_tensor_not_matching_metadata_is_one_line(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "hf", "qwen3")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["head_dim"] = 16
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _write_gguf(ckpt, tmp_path / "m.gguf", "qwen3", quantize=False)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_k_norm\.weight'|attn_q"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert not (tmp_path / "imported").exists()
