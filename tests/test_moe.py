"""Mixture-of-experts pieces the family tests (test_families.py: Qwen3-MoE compiled, Mixtral,
Qwen2-MoE and OLMoE eager, all against transformers) do not reach: the experts' fixed-shape
formulations against the op's eager definition, int8 experts, and what aotgen refuses."""

from __future__ import annotations

import pytest
import torch
from families import make_family_checkpoint

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.kernels.moe import experts_without_kernel, moe_experts, moe_experts_int8
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.package.build import build
from aotgen.passes.quantize_experts import int8_rows
from aotgen.passes.tp import parse_parallel, resolve_plan
from aotgen.recipe import Project, RecipeError, parse_recipe
from aotgen.runtime.engine import Engine

pytest.importorskip("transformers")


def _routed(tokens: int, experts: int = 8, k: int = 2, d: int = 16, f: int = 12):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, d, generator=g)
    probs = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, ids = probs.topk(k, dim=-1)
    gate_up = torch.randn(experts, 2 * f, d, generator=g) / d**0.5
    down = torch.randn(experts, d, f, generator=g) / f**0.5
    return x, weights, ids, gate_up, down


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("gather", [True, False])
def test_fixed_shape_experts_equal_the_routed_loop(tokens, gather):
    """Gathering each token's experts and running every expert under zero-padded routing
    weights both give the op's sum (transformers' loop over routed experts); with 40 tokens
    some experts get several, with 1 most get none."""
    args = _routed(tokens)
    want = moe_experts(*args)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(experts_without_kernel(*args, gather=gather), want)


def test_bfloat16_model_runs_without_the_kernel(tmp_path):
    """A bfloat16 model takes the fixed-shape path; its logits stay near float32's."""
    ckpt = open_checkpoint(make_family_checkpoint(tmp_path / "m", "mixtral"))
    cfg = ModelConfig.from_hf(ckpt.config)
    weights = ckpt.load_weights()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(cfg, dict(weights), 32, dtype)
        logits[dtype] = model(ids, torch.arange(8), new_kv_cache(cfg, 32, dtype))
    err = (logits[torch.bfloat16] - logits[torch.float32]).abs().max()
    assert err < 0.05 * logits[torch.float32].abs().max()


def test_bfloat16_package_runs_the_kernel_in_bfloat16(tmp_path, project):
    """A bfloat16 package: prefill (28 routed rows) and verify (10) through the kernel's
    bfloat16 matmuls, decode (2 rows) gathered; each within bfloat16 rounding of the float32
    eager model."""
    from reference import EagerModel
    from test_package import _graph_and_eager, _rel_err

    path = make_family_checkpoint(tmp_path / "m", "qwen3-moe")
    raw = {"checkpoint": str(path), "max_seq_len": 64, "prefill_chunk": 16, "verify_k": 4}
    package = build(parse_recipe({**raw, "dtype": "bfloat16"}, "moe-bf16", tmp_path), project)
    runner = Engine.load(package.path).target
    eager = EagerModel(path, runner.cache_len)
    for graph, length, start in [("prefill", 14, 0), ("decode", 1, 7), ("verify", 5, 9)]:
        got, want = _graph_and_eager(runner, eager, graph, length, start)
        assert _rel_err(got, want) < 2e-2, graph


def test_a_missing_expert_is_named(tmp_path):
    ckpt = open_checkpoint(make_family_checkpoint(tmp_path / "m", "olmoe"))
    weights = ckpt.load_weights()
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.1 has experts .* \(up\)"):
        load_model(ModelConfig.from_hf(ckpt.config), weights, 32, torch.float32)


def test_int8_experts_round_to_their_rows_scale():
    """Per-row symmetric int8: every weight within half a step of its row's scale, and the
    three ways to run int8 experts (the op, gathered, every expert) give one sum."""
    x, weights, ids, gate_up, down = _routed(40)
    q, scale = int8_rows(gate_up)
    assert q.dtype == torch.int8 and scale.shape == gate_up.shape[:2]
    assert ((q * scale[..., None] - gate_up).abs() <= scale[..., None] / 2 + 1e-7).all()
    qd, sd = int8_rows(down)
    want = moe_experts_int8(x, weights, ids, q, scale, qd, sd)
    for gather in (True, False):
        got = experts_without_kernel(x, weights, ids, q, qd, gather, (scale, sd))
        torch.testing.assert_close(got, want)
    dequantized = moe_experts(x, weights, ids, q * scale[..., None], qd * sd[..., None])
    torch.testing.assert_close(want, dequantized)


@pytest.mark.parametrize(
    ("family", "routers"),
    [("qwen3-moe", ["*.mlp.gate"]), ("qwen2-moe", ["*.mlp.gate", "*.mlp.shared_expert_gate"])],
)
def test_quantize_keeps_the_routers_float(tmp_path, family, routers):
    """The recipe's own skip patterns (a string or a list) and the routers' are kept; the
    experts go int8 with the linears, not with the embedding alone."""
    from aotgen.package.models import _experts_quantize

    cfg = ModelConfig.from_hf(open_checkpoint(make_family_checkpoint(tmp_path, family)).config)
    quantize, experts = _experts_quantize(cfg, {"linear": "int8", "skip": "lm_head"})
    assert quantize["skip"] == ["lm_head", *routers] and experts
    assert not _experts_quantize(cfg, {"embedding": "int8"})[1]


def test_quantized_routing_and_parallel_are_refused(tmp_path):
    """Integer activations and GGUF blocks do not apply to the experts, and there is no
    tensor-parallel plan for them: one-line errors before any compile."""
    path = make_family_checkpoint(tmp_path / "m", "qwen3-moe")
    for extra, why in [
        ({"quantize": {"linear": "int8", "activations": "int8"}}, "activations: int8 does not"),
        ({"parallel": {"tensor": 2}}, "no expert parallelism"),
    ]:
        recipe = parse_recipe({"checkpoint": str(path), **extra}, "moe", tmp_path)
        with pytest.raises(RecipeError, match=why):
            build(recipe, Project(tmp_path / "artifacts", cache_dir=tmp_path / "cache"))
        assert not (tmp_path / "artifacts" / "moe").exists()
    cfg = ModelConfig.from_hf(open_checkpoint(path).config)
    model = load_model(cfg, open_checkpoint(path).load_weights(), 32, torch.float32)
    with pytest.raises(RecipeError, match="mixture of experts"):
        resolve_plan(model, parse_parallel({"tensor": 2}))
