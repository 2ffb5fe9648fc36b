"""The language model of a vision-language checkpoint (Gemma 3 4B and up, Mistral Small 3.x,
Ministral 3) against transformers' own vision-language model given text only: tiny random
checkpoints written by transformers, in the layout and config it saves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from families import BASE, FAMILIES, RECIPE, randomize, reference_greedy, reference_logits
from reference import EagerModel
from safetensors.torch import load_file, save_file
from tiny import CHATML, make_tokenizer

from aotgen.checkpoint.hf import CheckpointError, open_checkpoint
from aotgen.checkpoint.multimodal import TEXT_ARCHITECTURES, TEXT_DEFAULTS, text_config
from aotgen.model.config import ModelConfig
from aotgen.package.build import build
from aotgen.recipe import parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

transformers = pytest.importorskip("transformers")

TEXT = dict(BASE, num_key_value_heads=2, head_dim=16)
VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1)
YARN_GAIN = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "llama_4_scaling_beta": 0.5,
}
QWEN3_5_VISION = dict(
    model_type="qwen3_5_vision",
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)
# Qwen2.5-VL's and Qwen3-VL's vision towers, small; their text models' multimodal RoPE sections
# (a head of 16: 8 frequencies over the time, height and width axes).
QWEN_VL_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
)
MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
QWEN3_VL_TEXT = dict(
    TEXT,
    model_type="qwen3_vl_text",
    num_hidden_layers=2,
    rope_parameters=dict(MROPE, mrope_interleaved=True),
)
QWEN3_VL_VISION = dict(QWEN_VL_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0])
# name → (config class, text_config, vision_config, top-level arguments)
MODELS = {
    # Gemma 3 4B's kind: test_families' Gemma 3 text model (window 8 on three layers in four,
    # linear scaling on the global one), so that its package's graphs are compile-cache hits.
    "gemma3": (
        "Gemma3Config",
        dict(BASE, **FAMILIES["gemma3"][1], model_type="gemma3_text"),
        dict(VISION, model_type="siglip_vision_model", image_size=28, patch_size=14),
        dict(mm_tokens_per_image=4),
    ),
    # Mistral Small 3.x's kind: a Mistral language model, its own head (untied).
    "mistral3": (
        "Mistral3Config",
        dict(TEXT, model_type="mistral", num_hidden_layers=2, sliding_window=None),
        dict(VISION, model_type="pixtral", image_size=28, patch_size=14, head_dim=16),
        dict(tie_word_embeddings=False),
    ),
    # Ministral 3's kind: YaRN and q growing with the position, a tied head.
    "ministral3": (
        "Mistral3Config",
        dict(TEXT, model_type="ministral3", num_hidden_layers=2, rope_parameters=YARN_GAIN),
        dict(VISION, model_type="pixtral", image_size=28, patch_size=14, head_dim=16),
        {},
    ),
    # Qwen2.5-VL's kind: a Qwen2 language model (q/k/v biases) whose multimodal RoPE gives
    # text one position on all three axes; its tensors as transformers 4.x laid them out.
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        dict(TEXT, model_type="qwen2_5_vl_text", num_hidden_layers=2, rope_parameters=MROPE),
        dict(QWEN_VL_VISION, fullatt_block_indexes=[0]),
        dict(tie_word_embeddings=False),
    ),
    # Qwen3-VL's kind: a Qwen3 language model (q/k norms), its RoPE sections interleaved.
    "qwen3_vl": (
        "Qwen3VLConfig",
        QWEN3_VL_TEXT,
        QWEN3_VL_VISION,
        dict(tie_word_embeddings=False),
    ),
    # Qwen3-VL-MoE's kind: a Qwen3-MoE language model (8 experts, 2 a token, renormalised),
    # its stacked experts stored transposed; a tied head.
    "qwen3_vl_moe": (
        "Qwen3VLMoeConfig",
        dict(
            QWEN3_VL_TEXT,
            model_type="qwen3_vl_moe_text",
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        QWEN3_VL_VISION,
        dict(tie_word_embeddings=True),
    ),
    # Qwen3.5's kind (every released size is a vision-language checkpoint): test_families'
    # Qwen3.5 text model, linear attention beside gated attention, an untied head.
    "qwen3_5": (
        "Qwen3_5Config",
        dict(BASE, **FAMILIES["qwen3_5"][1], model_type="qwen3_5_text"),
        QWEN3_5_VISION,
        dict(tie_word_embeddings=False),
    ),
    # Qwen3.5-MoE's kind: the same with test_families' experts.
    "qwen3_5-moe": (
        "Qwen3_5MoeConfig",
        dict(BASE, **FAMILIES["qwen3_5-moe"][1], model_type="qwen3_5_moe_text"),
        dict(QWEN3_5_VISION, model_type="qwen3_5_moe_vision"),
        dict(tie_word_embeddings=False),
    ),
}


# Qwen3.5's linear-attention keys → ModelConfig's fields.
QWEN3_5_KEYS = {
    "linear_conv_kernel": "linear_conv_kernel_dim",
    "linear_key_dim": "linear_key_head_dim",
    "linear_value_dim": "linear_value_head_dim",
    "linear_key_heads": "linear_num_key_heads",
    "linear_value_heads": "linear_num_value_heads",
}


def make_checkpoint(out: Path, name: str, seed: int = 0) -> Path:
    """A random vision-language model saved by transformers, with the test tokenizer and the
    chat template where a processor keeps it (chat_template.json)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    cls, text, vision, top = MODELS[name]
    ids = dict(
        bos_token_id=tok.token_to_id("<|im_start|>"), eos_token_id=tok.token_to_id("<|im_end|>")
    )
    config = getattr(transformers, cls)(
        text_config=dict(text, vocab_size=tok.get_vocab_size(), **ids),
        vision_config=vision,
        **top,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    randomize(model, gemma=name == "gemma3")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multimodal")
    return {name: make_checkpoint(root / name, name, seed=i) for i, name in enumerate(MODELS)}


def load_reference(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("name", MODELS)
def test_text_model_matches_transformers(checkpoints, name):
    """The language model read out of the checkpoint (vision tensors left unread) gives the
    logits over a history that crosses the window and the q-gain periods, and the 32 greedy
    tokens, of transformers' vision-language model given the same ids."""
    ckpt = open_checkpoint(checkpoints[name])
    assert ckpt.text_part and not any("vision" in n for n in ckpt.load_weights())
    eager = EagerModel(checkpoints[name], 96)
    reference = load_reference(checkpoints[name])
    history = torch.randint(0, eager.config.vocab_size, (40,), generator=torch.Generator()).tolist()
    got, want = eager.forward(history, 0), reference_logits(reference, history)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    assert eager.greedy(history[:20], 32) == reference_greedy(reference, history[:20], 32)
    assert eager.config.tie_word_embeddings == (name in ("gemma3", "ministral3", "qwen3_vl_moe"))


@pytest.mark.parametrize("kind", TEXT_DEFAULTS)
def test_sparse_text_config_reads_as_transformers(kind):
    """A text_config as transformers 4.x writes it (only what differs from its class's
    defaults; here nothing but the model type) reads as transformers reads it."""
    arch = next(a for a, kinds in TEXT_ARCHITECTURES.items() if kind in kinds)
    cfg = ModelConfig.from_hf(
        text_config({"architectures": [arch], "text_config": {"model_type": kind}}, [])
    )
    ref = transformers.AutoConfig.for_model(kind)
    assert cfg.hidden_act == getattr(ref, "hidden_activation", None) or ref.hidden_act
    moe = kind == "qwen3_5_moe_text"
    for key in (
        "vocab_size",
        "hidden_size",
        "moe_intermediate_size" if moe else "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "sliding_window",
    ):
        assert getattr(cfg, key) == getattr(ref, key, None), key
    head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    assert cfg.head_dim == head_dim
    if kind == "ministral3":
        scaling = ref.rope_parameters
        assert cfg.rope_theta == scaling["rope_theta"]
        assert cfg.rope_scaling["factor"] == scaling["factor"]
        assert cfg.query_gain_beta == scaling["llama_4_scaling_beta"]
    if moe:
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (ref.num_experts, 8)
        assert cfg.shared_expert_intermediate_size == ref.shared_expert_intermediate_size
    if kind.startswith("qwen3_5"):
        assert cfg.layer_types == tuple(ref.layer_types)
        assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
        assert cfg.rotary_dim == int(head_dim * ref.rope_parameters["partial_rotary_factor"])
        for ours, theirs in QWEN3_5_KEYS.items():
            assert getattr(cfg, ours) == getattr(ref, theirs), theirs


def test_qwen2_5_vl_config_of_transformers_4(checkpoints, tmp_path):
    """Qwen2.5-VL as transformers 4.x wrote it (and most of its checkpoints ship): no
    text_config, the language model's keys at the top level, RoPE as `rope_scaling` of type
    "mrope". Read as the nested config is: the same logits."""
    flat = tmp_path / "flat"
    shutil.copytree(checkpoints["qwen2_5_vl"], flat)
    config = json.loads((flat / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    sections = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config = {**text, **config, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"]}
    (flat / "config.json").write_text(json.dumps({**config, "rope_scaling": sections}))
    history = torch.randint(0, 300, (24,), generator=torch.Generator()).tolist()
    want = EagerModel(checkpoints["qwen2_5_vl"], 64).forward(history, 0)
    assert torch.equal(EagerModel(flat, 64).forward(history, 0), want)


def test_qwen3_vl_moe_experts_as_released(checkpoints, tmp_path):
    """Qwen3-VL-MoE's released checkpoints hold the stacked experts transposed against
    transformers 5's saves (`gate_up_proj [E, d, 2f]`, `down_proj [E, f, d]`): both read to the
    same model."""
    released = tmp_path / "released"
    shutil.copytree(checkpoints["qwen3_vl_moe"], released)
    path = released / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    history = torch.randint(0, 300, (24,), generator=torch.Generator()).tolist()
    want = EagerModel(checkpoints["qwen3_vl_moe"], 64).forward(history, 0)
    assert torch.equal(EagerModel(released, 64).forward(history, 0), want)


def test_unsupported_text_model_is_one_line(tmp_path):
    d = make_checkpoint(tmp_path / "m", "mistral3")
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config model_type 'llama' is not supported"):
        open_checkpoint(d)


def test_package_of_a_vision_language_checkpoint(checkpoints, project):
    """Built into a package: its greedy tokens are transformers', and the chat template the
    processor keeps (chat_template.json) renders the chat."""
    recipe = {**RECIPE, "checkpoint": str(checkpoints["gemma3"]), "formats": ["aoti"]}
    engine = Engine.load(build(parse_recipe(recipe, "vlm-gemma3", Path(".")), project).path)
    ids = engine.tokenizer.encode("Speculative decoding drafts tokens and verifies them.")
    got = engine.generate(ids, GenerationConfig(max_new_tokens=16, ignore_eos=True))
    assert got.token_ids == reference_greedy(load_reference(checkpoints["gemma3"]), ids, 16)
    prompt = engine.tokenizer.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
