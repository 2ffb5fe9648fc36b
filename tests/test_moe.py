"""Mixture-of-experts pieces the family tests (test_families.py: Qwen3-MoE compiled, Mixtral,
Qwen2-MoE and OLMoE eager, all against transformers) do not reach: the experts' fixed-shape
formulations against the op's eager definition, int8 experts, experts in packed panels,
gpt-oss's biased experts and clamped SwiGLU against transformers, and what aotgen refuses."""

from __future__ import annotations

import pytest
import torch
from families import make_family_checkpoint
from torch import Tensor

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.kernels.moe import experts_without_kernel, moe_experts, moe_experts_int8
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.model.moe import Experts
from aotgen.package.build import build
from aotgen.passes.quantize_experts import Int8Experts, int8_rows
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


def _gpt_oss(tokens: int, dtype=torch.float32, experts: int = 8, k: int = 2, d=16, f=12):
    """transformers' `GptOssExperts` (limit 7, alpha 1.702) with random weights and biases
    large enough that the clamp acts on many gates and ups, `tokens` routed rows, and its
    experts in aotgen's layout: (module, (x, weights, ids, gate_up, down), (gate_up_bias,
    down_bias, limit, alpha)). Its `gate_up_proj [E, d, 2f]` interleaves gate and up columns:
    gate = ::2, up = 1::2, transposed into `[E, 2f, d]` gate rows then up rows."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = GptOssConfig(
        hidden_size=d, intermediate_size=f, num_local_experts=experts, num_experts_per_tok=k
    )
    hf._experts_implementation = "eager"
    module = GptOssExperts(hf)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(experts, d, 2 * f, generator=g) * 1.5 / d**0.5)
        module.gate_up_proj_bias.copy_(torch.randn(experts, 2 * f, generator=g))
        module.down_proj.copy_(torch.randn(experts, f, d, generator=g) / f**0.5)
        module.down_proj_bias.copy_(torch.randn(experts, d, generator=g))
    module.to(dtype).requires_grad_(False)
    x = (torch.randn(tokens, d, generator=g) * 3).to(dtype)
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(k, dim=-1)
    w, b = module.gate_up_proj, module.gate_up_proj_bias
    gate_up = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    gate_up_bias = torch.cat([b[:, ::2], b[:, 1::2]], dim=-1)
    down = module.down_proj.transpose(1, 2).contiguous()
    extra = (gate_up_bias, module.down_proj_bias, hf.swiglu_limit, hf.swiglu_alpha)
    return module, (x, weights, ids, gate_up, down), extra


def _gpt_oss_experts_config(d: int = 16, f: int = 12, experts: int = 8) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=d, intermediate_size=f, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=d, num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=f, expert_biases=True,
        swiglu_limit=7.0, swiglu_alpha=1.702,
    )  # fmt: skip


def _close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    """float32: assert_close's tolerances; bfloat16: within 2% of the largest output (its
    rounding, in different places than transformers')."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want)
    else:
        assert got.dtype == dtype
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["op", "gather", "every expert"])
def test_biased_clamped_experts_equal_gpt_oss(dtype, path):
    """gpt-oss's experts (biases, clamped SwiGLU) through the op's eager definition and both
    fixed-shape formulations equal transformers' GptOssExperts on the same weights and
    routing; without the clamp these inputs give a far different sum."""
    module, args, extra = _gpt_oss(40, dtype)
    x, weights, ids = args[:3]
    want = module(x, ids, weights)
    if path == "op":
        got = moe_experts(*args, *extra)
    else:
        got = experts_without_kernel(*args, path == "gather", None, *extra)
    _close(got, want, dtype)
    unclamped = moe_experts(*args, *extra[:2], 1e4, extra[3])
    assert (unclamped.float() - want.float()).abs().max() > 0.5 * want.float().abs().max()


@pytest.mark.parametrize("tokens", [1, 40])
def test_gpt_oss_experts_module_and_its_int8_form(tokens):
    """`Experts` built from a gpt-oss config holds the biases and the activation and equals
    GptOssExperts (1 row gathered, 40 through the op); `Int8Experts` keeps the biases float
    and the activation, lands within int8's error of it, and its three formulations agree."""
    module, (x, weights, ids, gate_up, down), (gub, db, limit, alpha) = _gpt_oss(tokens)
    experts = Experts(_gpt_oss_experts_config())
    experts.load_state_dict(
        {"gate_up_proj": gate_up, "down_proj": down, "gate_up_proj_bias": gub,
         "down_proj_bias": db}
    )  # fmt: skip
    assert (experts.limit, experts.alpha) == (7.0, 1.702)
    want = module(x, ids, weights)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids), want)
        int8 = Int8Experts(experts)
        assert int8.gate_up_proj.dtype == torch.int8
        assert torch.equal(int8.gate_up_proj_bias, gub) and torch.equal(int8.down_proj_bias, db)
        assert (int8.limit, int8.alpha) == (limit, alpha)
        got = int8(x, weights, ids)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    q = (int8.gate_up_proj, int8.gate_up_scale, int8.down_proj, int8.down_scale)
    op = moe_experts_int8(x, weights, ids, *q, gub, db, limit, alpha)
    torch.testing.assert_close(got, op)
    for gather in (True, False):
        fixed = experts_without_kernel(
            x, weights, ids, q[0], q[2], gather, (q[1], q[3]), gub, db, limit, alpha
        )
        torch.testing.assert_close(fixed, op)


class BiasedExperts(torch.nn.Module):
    """The experts' ops as a graph calls them: with both biases and the clamp in float32,
    bfloat16 and int8, with only the down projection's bias, and with neither (AOTInductor
    passes the shim a pointer to each optional bias' handle, null for None)."""

    def forward(self, x, weights, ids, gate_up, down, gub, db, x16, gate_up16, down16, gub16,
                db16, q, q_scale, qd, qd_scale):  # fmt: skip
        ops = torch.ops.aotgen
        return (
            ops.moe_experts(x, weights, ids, gate_up, down, gub, db, 7.0, 1.702),
            ops.moe_experts(x16, weights, ids, gate_up16, down16, gub16, db16, 7.0, 1.702),
            ops.moe_experts_int8(x, weights, ids, q, q_scale, qd, qd_scale, gub, db, 7.0, 1.702),
            ops.moe_experts(x, weights, ids, gate_up, down, None, db),
            ops.moe_experts(x, weights, ids, gate_up, down),
        )


def test_compiled_graph_runs_biased_clamped_experts(compile_exported):
    """An AOTInductor graph calling the ops through the kernel's C shims gives their eager
    results (float32 and int8 to float32 precision, bfloat16 within its rounding)."""
    _, (x, weights, ids, gate_up, down), (gub, db, _, _) = _gpt_oss(40)
    bf16 = [t.to(torch.bfloat16) for t in (x, gate_up, down, gub, db)]
    q, q_scale = int8_rows(gate_up)
    qd, qd_scale = int8_rows(down)
    args = (x, weights, ids, gate_up, down, gub, db, *bf16, q, q_scale, qd, qd_scale)
    ep = torch.export.export(BiasedExperts(), args)
    compiled = compile_exported(ep, args)
    eager = BiasedExperts()(*args)
    dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32)
    for out, expect, dtype in zip(compiled(*args), eager, dtypes, strict=True):
        _close(out, expect, dtype)
    assert (eager[3] - eager[4]).abs().max() > 0.1  # the bias counts


class PanelOps(torch.nn.Module):
    """`moe_experts_panels` as a graph calls it: float32 and int8 experts, biased and clamped,
    float32 without biases (AOTInductor passes null handles for the optional tensors), and
    bfloat16 (activations, weights and biases)."""

    def forward(self, x, weights, ids, gate_up, down, gub, db, q, q_scale, qd, qd_scale, *bf16):
        panels = torch.ops.aotgen.moe_experts_panels
        xb, gate_up_b, down_b, gub_b, db_b = bf16
        return (
            panels(x, weights, ids, gate_up, None, down, None, gub, db, 7.0, 1.702),
            panels(x, weights, ids, q, q_scale, qd, qd_scale, gub, db, 7.0, 1.702),
            panels(x, weights, ids, gate_up, None, down, None),
            panels(xb, weights, ids, gate_up_b, None, down_b, None, gub_b, db_b, 7.0, 1.702),
        )


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_compiled_experts_on_panels_equal_the_rows(tokens, compile_exported):
    """Experts in packed panels (passes/pack_experts.py), through the kernel's C shim: one
    token (its experts one after another, each projection threaded), a few, and 40 (several
    rows an expert, experts in parallel) give the row-layout ops' eager sums, biases and
    clamp included, float32 and int8; bfloat16 gives the float32 sum of its values, rounded
    once (the kernel widens the weights exactly and multiplies in float32)."""
    from aotgen.passes.pack_experts import _panels

    _, (x, weights, ids, gate_up, down), (gub, db, _, _) = _gpt_oss(tokens, d=32, f=24)
    q, q_scale = int8_rows(gate_up)
    qd, qd_scale = int8_rows(down)
    bf16 = [t.to(torch.bfloat16) for t in (x, gate_up, down, gub, db)]
    args = (x, weights, ids, _panels(gate_up), _panels(down), gub, db)
    args += (_panels(q), q_scale, _panels(qd), qd_scale)
    args += (bf16[0], _panels(bf16[1]), _panels(bf16[2]), bf16[3], bf16[4])
    want = (
        moe_experts(x, weights, ids, gate_up, down, gub, db, 7.0, 1.702),
        moe_experts_int8(x, weights, ids, q, q_scale, qd, qd_scale, gub, db, 7.0, 1.702),
        moe_experts(x, weights, ids, gate_up, down),
    )
    xw, *widened = [t.float() for t in bf16]
    bf16_sum = moe_experts(xw, weights, ids, *widened, 7.0, 1.702)
    compiled = compile_exported(torch.export.export(PanelOps(), args), args)
    got, eager = compiled(*args), PanelOps()(*args)
    for out, eager_out, expect in zip(got[:3], eager[:3], want, strict=True):
        torch.testing.assert_close(eager_out, expect)
        torch.testing.assert_close(out, expect)
    assert got[3].dtype == torch.bfloat16
    torch.testing.assert_close(got[3].float(), bf16_sum.to(torch.bfloat16).float())
    _close(eager[3], bf16_sum, torch.bfloat16)  # the op's eager definition: bfloat16 math
    assert (want[0] - want[1]).abs().max() > 0  # int8 is not float32


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
    bfloat16 matmuls and decode (2 rows) gathered, or every graph on bfloat16 panels where the
    build measured them faster than the CPU's bfloat16 matmul; each within bfloat16 rounding of
    the float32 eager model."""
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
    """Integer activations do not apply to the experts, and there is no
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
