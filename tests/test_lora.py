"""LoRA adapters merged at build (passes/lora.py) against PEFT, the reference: adapters PEFT
trains-shaped (random A and B) on the families' tiny checkpoints (Llama, Qwen2, Gemma 3, Phi-3,
GPT-NeoX), PEFT's own forward of the
adapted model vs aotgen's eager model on the merged weights, for every adapter form (linears,
embeddings, rsLoRA, rank and alpha patterns, lora_bias, modules_to_save, tied heads); a compiled
package's logits and greedy tokens; the bad adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import load_reference, make_family_checkpoint, reference_greedy
from safetensors.torch import load_file, save_file

from aotgen.checkpoint.hf import CheckpointError, open_checkpoint
from aotgen.model.llama import load_model, new_kv_cache
from aotgen.package.build import build
from aotgen.package.models import merged_weights
from aotgen.passes.lora import open_adapter
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

peft = pytest.importorskip("peft")

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 19, 23]
# Merged fp32 weights vs PEFT's unmerged forward (x W^T + s x A^T B^T): rounding-level apart.
TOL = 1e-4
# Adapter forms -> PEFT LoraConfig arguments per family (the modules each family names).
LINEARS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gptneox-parallel": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}
LINEARS["qwen2-tied"] = LINEARS["gemma3"] = LINEARS["llama"]
LINEARS["phi3"] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # fused: split after
EMBED_HEAD = {"gptneox-parallel": ["embed_in", "embed_out"]}
FORMS = {
    "linears": lambda family: {"target_modules": LINEARS[family]},
    # rsLoRA, per-module ranks and alphas, the embedding and the head (untied from each other
    # where the checkpoint ties them), a whole norm trained and saved.
    "patterns": lambda family: {
        "target_modules": [LINEARS[family][0], LINEARS[family][-1]]
        + EMBED_HEAD.get(family, ["embed_tokens", "lm_head"]),
        "use_rslora": True,
        "rank_pattern": {LINEARS[family][0]: 2},
        "alpha_pattern": {LINEARS[family][-1]: 3},
        "modules_to_save": ["final_layer_norm" if family.startswith("gpt") else "norm"],
    },
}


def _adapter(base: Path, out: Path, seed: int, **lora_args) -> Path:
    """A random adapter of `base` saved by PEFT (random B too: a fresh adapter's B is 0)."""
    model = load_reference(base)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora_args)
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    adapted.save_pretrained(out)
    return out


def _peft_logits(base: Path, adapter: Path, ids: list[int]) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(load_reference(base), adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def _merged_logits(base: Path, adapters: list[Path], ids: list[int]) -> torch.Tensor:
    """aotgen's eager model on the merged weights."""
    cfg, weights = merged_weights(open_checkpoint(base), [open_adapter(a) for a in adapters])
    model = load_model(cfg, weights, 64, torch.float32)
    return model(torch.tensor([ids]), torch.arange(len(ids)), new_kv_cache(cfg, 64))[0]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-bases")
    names = ["llama", "qwen2-tied", "gemma3", "phi3", "gptneox-parallel"]
    return {n: make_family_checkpoint(root / n, n, seed=i) for i, n in enumerate(names)}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "gemma3", "phi3", "gptneox-parallel"])
def test_merged_weights_compute_what_peft_computes(bases, tmp_path, family, form):
    adapter = _adapter(bases[family], tmp_path / "adapter", seed=3, **FORMS[form](family))
    want = _peft_logits(bases[family], adapter, PROMPT)
    got = _merged_logits(bases[family], [adapter], PROMPT)
    base = _merged_logits(bases[family], [], PROMPT)
    assert (want - base).abs().max() > 0.1  # the adapter changes the model: a real check
    assert (got - want).abs().max() / want.abs().max() < TOL


def test_lora_bias_and_two_adapters(bases, tmp_path):
    """`lora_bias` (Qwen2's biased q/k/v), and two adapters stacked: their updates add up, as
    PEFT's forward with both adapters active computes."""
    base = bases["qwen2-tied"]
    first = _adapter(base, tmp_path / "a", seed=1, target_modules=["q_proj", "v_proj"])
    second = _adapter(
        base, tmp_path / "b", seed=2, target_modules=["k_proj", "v_proj"], lora_bias=True
    )
    model = peft.PeftModel.from_pretrained(load_reference(base), first, adapter_name="a")
    model.load_adapter(second, adapter_name="b")
    model.base_model.set_adapter(["a", "b"])
    with torch.no_grad():
        want = model.eval()(torch.tensor([PROMPT]), use_cache=False).logits[0]
    got = _merged_logits(base, [first, second], PROMPT)
    assert (got - want).abs().max() / want.abs().max() < TOL


def test_package_with_an_adapter_equals_peft(bases, tmp_path, project):
    """The whole build: a recipe with `lora:` compiles the merged model; its prefill logits
    and 24 greedy tokens equal PEFT's adapted model's."""
    base = bases["llama"]
    adapter = _adapter(base, tmp_path / "adapter", seed=5, **FORMS["patterns"]("llama"))
    recipe = {"checkpoint": str(base), "lora": str(adapter), "max_seq_len": 96}
    recipe |= {"prefill_chunk": 16, "verify_k": 4}
    package = build(parse_recipe(recipe, "lora-llama", tmp_path), project).path
    engine = Engine.load(package, threads=1)
    want = _peft_logits(base, adapter, PROMPT)
    got = engine.target.forward(PROMPT, 0, all_logits=True)
    assert (got - want).abs().max() / want.abs().max() < TOL
    model = peft.PeftModel.from_pretrained(load_reference(base), adapter).eval()
    config = GenerationConfig(24, ignore_eos=True, reuse_prefix=False)
    assert engine.generate(PROMPT, config).token_ids == reference_greedy(model, PROMPT, 24)
    manifest = json.loads((package / "manifest.json").read_text())
    assert manifest["recipe"]["lora"] == [str(adapter)]


def _break(adapter: Path, how: str) -> None:
    config = json.loads((adapter / "adapter_config.json").read_text())
    if how == "dora":
        config["use_dora"] = True
    elif how == "not-lora":
        config["peft_type"] = "IA3"
    elif how == "pickle":
        (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    elif how == "alpha-text":
        config["lora_alpha"] = "sixteen"
    elif how == "no-config":
        (adapter / "adapter_config.json").unlink()
        return
    (adapter / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "how, words",
    [
        ("dora", "sets use_dora: that variant is not a weight update"),
        ("not-lora", "is a IA3 adapter: aotgen merges LoRA adapters only"),
        ("pickle", "holds adapter_model.bin, a pickle aotgen never loads"),
        ("no-config", "has no adapter_config.json"),
        ("alpha-text", "lora_alpha and alpha_pattern values must be positive numbers"),
    ],
)
def test_bad_adapters_are_refused(bases, tmp_path, how, words):
    adapter = _adapter(bases["llama"], tmp_path / "adapter", seed=0, target_modules=["q_proj"])
    _break(adapter, how)
    with pytest.raises(CheckpointError, match=words):
        open_adapter(adapter)


def test_an_adapter_of_another_model_is_refused(bases, tmp_path):
    # GPT-NeoX's module names on the Llama checkpoint.
    adapter = _adapter(bases["gptneox-parallel"], tmp_path / "a", seed=0, target_modules=["dense"])
    with pytest.raises(CheckpointError, match="which the checkpoint does not have"):
        merged_weights(open_checkpoint(bases["llama"]), [open_adapter(adapter)])
    # Llama's names, a wider model's shapes.
    adapter = _adapter(bases["llama"], tmp_path / "b", seed=0, target_modules=["q_proj"])
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if "lora_B" in name:
            tensors[name] = torch.zeros(2 * t.shape[0], t.shape[1])
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"with shape \(\d+, \d+\), but the checkpoint's is"):
        merged_weights(open_checkpoint(bases["llama"]), [open_adapter(adapter)])


@pytest.mark.parametrize(
    "lora, words",
    [
        (5, "lora must be a PEFT adapter directory or a list of them"),
        ([""], "lora must be a PEFT adapter directory or a list of them"),
    ],
)
def test_bad_lora_recipe_values_are_refused(lora, words):
    with pytest.raises(RecipeError, match=words):
        parse_recipe({"checkpoint": "ckpt", "lora": lora}, "r", Path("."))
