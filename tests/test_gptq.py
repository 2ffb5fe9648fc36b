"""GPTQ (`quantize: {method: gptq}`, issue 3): the algorithm against round-to-nearest, the
Hessians against an eager reference, and a tiny compiled build against its eager graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from reference import reset_caches
from safetensors import safe_open

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.export.aoti import calibration_spec, export_graph, graph_specs
from aotgen.kernels.packed import unpack
from aotgen.model.llama import new_kv_cache
from aotgen.package.build import build
from aotgen.package.models import ModelBuild
from aotgen.package.models import calibrate as _calibrate
from aotgen.passes.gemv import linears_as_reductions
from aotgen.passes.gptq import gptq_codes, input_hessians
from aotgen.passes.pack import PackLinears
from aotgen.passes.quantize import QuantizePass
from aotgen.passes.quantize_numerics import dequantize_int4, quantize_int4, quantize_int8
from aotgen.passes.quantize_options import parse_quantize
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.engine import Engine
from aotgen.runtime.tokenizer import Tokenizer

# g128 on the tiny model's 64-wide inputs: GPTQ on zero-padded weights (passes/quantize.py)
GPTQ_INT4 = {
    "linear": {"int4": {"groupsize": 128}},
    "overrides": {"lm_head": "int8"},
    "method": "gptq",
}
GPTQ_INT8 = {"linear": "int8", "embedding": "int8", "method": "gptq"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _correlated_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """n samples of one fixed distribution with correlated channels and a few large ones, as
    LLM activations have; `seed` draws the samples only."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=g)[: k // 16]] = 8.0
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) @ mix) * scale


# ---- the algorithm ---------------------------------------------------------------------------
def test_uncorrelated_inputs_give_round_to_nearest():
    """With H = I no column's error can be absorbed by another: GPTQ is round-to-nearest."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    q, sz = quantize_int4(w, 32, torch.bfloat16)
    scale, zero = sz.float().transpose(0, 1).repeat_interleave(32, dim=1).unbind(-1)
    codes = gptq_codes(w, torch.eye(128), scale, zero, 0, 15, offset=8)
    assert torch.equal(codes, q)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gptq_cuts_output_error_on_held_out_inputs(scheme):
    """Calibrated on one sample of correlated inputs, GPTQ's integers give a smaller output
    error ||X (W - W_q)^T|| than round-to-nearest on another sample of the same
    distribution, with the same scales (measured: 0.73x for int4 g32, 0.56x for int8)."""
    k, n = 256, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    calib, held_out = _correlated_inputs(2048, k, seed=2), _correlated_inputs(2048, k, seed=3)
    hessian = calib.T @ calib
    if scheme == "int4":
        q, sz = quantize_int4(w, 32, torch.float32, importance=torch.diagonal(hessian))
        scale, zero = sz.transpose(0, 1).repeat_interleave(32, dim=1).unbind(-1)
        codes = gptq_codes(w, hessian, scale, zero, 0, 15, offset=8)
        rtn, gptq = dequantize_int4(q, sz, 32), dequantize_int4(codes, sz, 32)
    else:
        q, s = quantize_int8(w, torch.float32)
        scale = s[:, None].expand_as(w)
        codes = gptq_codes(w, hessian, scale, torch.zeros_like(scale), -128, 127)
        rtn, gptq = q.float() * scale, codes.float() * scale
        assert codes.abs().max() <= 128
    err_rtn = (held_out @ (w - rtn).T).norm()
    err_gptq = (held_out @ (w - gptq).T).norm()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_importance_weights_the_group_fit():
    """With all importance on one column of each group, that column's weight error drops
    (against the unweighted fit) and the weighted error is never worse."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    imp = torch.full((128,), 1e-3)
    imp[::32] = 1.0
    plain = dequantize_int4(*quantize_int4(w, 32, torch.float32), 32)
    weighted = dequantize_int4(*quantize_int4(w, 32, torch.float32, importance=imp), 32)
    err = {name: (d - w).pow(2) for name, d in (("plain", plain), ("weighted", weighted))}
    assert err["weighted"][:, ::32].sum() < 0.5 * err["plain"][:, ::32].sum()
    assert (err["weighted"] * imp).sum() <= (err["plain"] * imp).sum()


# ---- Hessians on the exported graph ----------------------------------------------------------
def test_input_hessians_match_eager_hooks(tiny_model):
    """X^T X per linear, from interpreting the exported prefill graph, equals the same sum
    taken with forward hooks on the eager nn.Linear modules."""
    model, cfg, cache_len = tiny_model
    spec = calibration_spec(TINY_RECIPE["prefill_chunk"])
    ep = export_graph(model, spec, new_kv_cache(cfg, cache_len))
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randint(0, cfg.vocab_size, (1, t), generator=g), torch.arange(t))
        for t in (16, 9, 16)
    ]
    got = input_hessians(ep, [(*b, new_kv_cache(cfg, cache_len)) for b in batches])

    want: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(mod, inp, out, key=f"{name}.weight"):
                x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                want[key] = want.get(key, 0) + x.T @ x

            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for tokens, pos in batches:
            model(tokens, pos, new_kv_cache(cfg, cache_len))
    for h in hooks:
        h.remove()
    # lm_head is tied in neither name nor tensor here; every linear must be found.
    assert set(got) == set(want)
    for key in want:
        assert _rel(got[key], want[key].float()) < 1e-5, key


# ---- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, match",
    [
        ({"linear": "int8", "method": "awq"}, "quantize.method: 'awq'; valid: rtn, gptq"),
        ({"linear": "int8", "calibration": "x.txt"}, "only `method: gptq` reads"),
        ({"linear": "int8", "method": "gptq", "calibration": "/nonexistent.txt"}, "not a file"),
    ],
)
def test_bad_gptq_options(raw, match):
    with pytest.raises(RecipeError, match=match):
        parse_quantize(raw)


def test_calibration_path_resolves_against_the_recipe_dir(tmp_path):
    (tmp_path / "calib.txt").write_text("some text")
    raw = {"linear": "int8", "method": "gptq", "calibration": "calib.txt"}
    recipe = parse_recipe({"checkpoint": "c", "quantize": raw}, "r", tmp_path)
    assert parse_quantize(recipe.quantize).calibration == tmp_path / "calib.txt"


def test_gptq_refuses_tensor_parallel(tiny_checkpoint, project):
    recipe = parse_recipe(
        {
            "checkpoint": str(tiny_checkpoint),
            **TINY_RECIPE,
            "quantize": GPTQ_INT4,
            "parallel": {"tensor": 2},
        },
        "tiny-gptq-tp",
        Path("."),
    )
    with pytest.raises(RecipeError, match="gptq does not combine with `parallel`"):
        build(recipe, project)
    assert not (project.artifacts_dir / "tiny-gptq-tp").exists()


# ---- a compiled build ------------------------------------------------------------------------
def _recipe(checkpoint: Path, quantize: dict, name: str):
    return parse_recipe(
        {"checkpoint": str(checkpoint), **TINY_RECIPE, "quantize": quantize}, name, Path(".")
    )


@pytest.fixture(scope="module")
def gptq_build(tiny_checkpoint, project):
    return build(_recipe(tiny_checkpoint, GPTQ_INT4, "tiny-gptq-int4"), project)


def test_build_records_gptq(gptq_build):
    manifest = json.loads((gptq_build.path / "manifest.json").read_text())
    q = manifest["models"]["target"]["quantization"]
    assert q["method"] == "gptq"
    assert q["calibration"]["text"] == "calibration.txt" and q["calibration"]["tokens"] > 1000
    assert any("rounded by GPTQ" in n for n in gptq_build.notes)
    ppl = gptq_build.perplexity
    assert abs(ppl["package"] / ppl["reference"] - 1) < 0.1, ppl


def test_compiled_gptq_matches_its_eager_graphs(gptq_build, tiny_checkpoint, tiny_model):
    """The package's graphs vs the same passes run eagerly after the builder's calibration
    (tight: same integers, same kernels), and vs the fp32 model (loose: int4 noise)."""
    model, cfg, cache_len = tiny_model
    recipe = _recipe(tiny_checkpoint, GPTQ_INT4, "tiny-gptq-int4")
    qp = QuantizePass(parse_quantize(GPTQ_INT4))
    specs = graph_specs(TINY_RECIPE["prefill_chunk"], TINY_RECIPE["verify_k"])
    _calibrate(
        ModelBuild("target", model, cfg, specs, [qp]), recipe, Tokenizer.from_dir(tiny_checkpoint)
    )
    runner = Engine.load(gptq_build.path).target
    pack = PackLinears(lambda *_: (4, 2))  # the builder's next pass; its eager op is float math
    g = torch.Generator().manual_seed(6)
    for spec in specs:
        cache_q, cache_f = new_kv_cache(cfg, cache_len), new_kv_cache(cfg, cache_len)
        ep = pack(qp(export_graph(model, spec, cache_q)), spec.max_tokens)
        eager = (ep if spec.dynamic else linears_as_reductions(ep)).module()
        t = min(spec.max_tokens, 11)
        tokens = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
        pos = torch.arange(t)
        reset_caches(runner)
        with torch.no_grad():
            got = runner.graphs[spec.name](tokens, pos, runner.caches)
            ref_q = eager(tokens, pos, cache_q)
            ref = model(tokens, pos, cache_f)
        if spec.last_row_logits:
            ref = ref[:, -1:]
        assert got.shape == ref_q.shape == ref.shape, spec.name
        assert _rel(got, ref_q) < 1e-4, spec.name
        assert _rel(got, ref) < 0.15, spec.name


def test_tied_weight_gets_gptq_for_lm_head_and_nearest_for_embedding(tied_checkpoint, project):
    """One tied tensor, two roles: lm_head's int8 copy is GPTQ-rounded against its inputs,
    the embedding's is rounded to nearest (an embedding has no matmul input to fit)."""
    report = build(_recipe(tied_checkpoint, GPTQ_INT8, "tiny-gptq-tied"), project)
    with safe_open(str(report.path / "rank0" / "target.safetensors"), "pt") as f:
        # export names the tied tensor after one of its users (here lm_head.weight)
        tied = ("lm_head.", "model.embed_tokens.")
        # lm_head's copy is packed into panels (compile.packed_linears)
        (gptq,) = [n for n in f.keys() if n.startswith(tied) and n.endswith("_gptq_int8_packed")]
        embedding = f.get_tensor(gptq.replace("_gptq", "").removesuffix("_packed"))
        lm_head = unpack(f.get_tensor(gptq))[: len(embedding)]
        assert not {"lm_head.weight", "model.embed_tokens.weight"} & set(f.keys())
    source = open_checkpoint(tied_checkpoint).load_weights()["model.embed_tokens.weight"]
    assert torch.equal(embedding, quantize_int8(source, torch.bfloat16)[0])
    assert not torch.equal(lm_head, embedding)
    assert (lm_head.int() - embedding.int()).abs().max() <= 127  # the same scales, other integers
