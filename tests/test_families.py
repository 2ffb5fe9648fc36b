"""Every supported family against `transformers`, the reference implementation: tiny
random checkpoints written by transformers (tests/families.py) go through the real build,
and the package's prefill / decode / verify logits and greedy tokens are compared with
transformers' eager forward in fp32. Also: int8 + fused builds of the biased families,
separate-checkpoint drafts, the tensor-parallel plans, and config errors."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import have_onnx, stop_warming
from families import (
    EAGER_PARITY,
    INT8,
    INT8_FAMILIES,
    MOE,
    PARITY,
    RECIPE,
    SPEC_PAIRS,
    WINDOWED,
    family_checkpoints,
    family_recipe,
    make_family_checkpoint,
    reference_greedy,
    reference_logits,
)
from families import load_reference as _load_reference
from reference import EagerModel, reset_caches
from test_cpp_batch import cpp_results, request_json, run_batch
from test_cpp_runtime import cpp_generate
from test_tree import SHAPES, make_tree, path_to

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.model.rope import for_context
from aotgen.package.build import build
from aotgen.passes import tp
from aotgen.passes.tp import parse_parallel, resolve_plan, shard_model
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.tree_draft import TreeParams

pytest.importorskip("transformers")

# ONNX graphs too where the aotgen[onnx] extra is installed, in the plain packages that ONNX
# Runtime runs (test_onnx_graphs_match_..., test_separate_draft_through_onnx_runtime).
FORMATS = ["aoti", "onnx"] if have_onnx() else ["aoti"]
HAVE_ONNX = "onnx" in FORMATS
# Longer than Gemma's window (8) and than one prefill chunk (16 tokens).
PROMPT = "Speculative decoding drafts tokens and verifies them in one pass. The quick brown fox"
N_GREEDY = 32
# Compiled fp32 vs transformers' eager fp32: the same math in another order (Inductor's
# fused reductions, the gemv rewrite, SDPA vs matmul-softmax), so errors are rounding-level,
# ~1e-6 relative (measured 2e-7 to 6e-7 for the eager definitions). A wrong norm, bias,
# RoPE dim, window or scale moves the logits by 1e-2 or more; 1e-4 separates the two.
FP32_TOL = 1e-4
# Weight-only int8 (per-channel) of random weights: ~1 % relative error on the logits.
INT8_TOL = 5e-2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return family_checkpoints(tmp_path_factory.mktemp("families"))


_packages: dict[str, Path] = {}
_references: dict[str, torch.nn.Module] = {}


def load_reference(path: Path) -> torch.nn.Module:
    if str(path) not in _references:
        _references[str(path)] = _load_reference(path)
    return _references[str(path)]


def _package(family: str, checkpoints: dict[str, Path], project, **extra) -> Path:
    """One build per (family, options), shared by this module's tests."""
    name, data = family_recipe(family, checkpoints, ["aoti"] if extra else FORMATS, extra)
    if name not in _packages:
        _packages[name] = build(parse_recipe(data, name, Path(".")), project).path
    return _packages[name]


@pytest.fixture(scope="module")
def family_engines(request, checkpoints, project):
    stop_warming(request, "families")  # the builds take what the background compiled
    cache: dict[Path, Engine] = {}

    def get(family: str, **extra) -> Engine:
        path = _package(family, checkpoints, project, **extra)
        if path not in cache:
            cache[path] = Engine.load(path)
        return cache[path]

    return get


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "graph,start,length",
    [("prefill", 0, 14), ("prefill", 7, 16), ("decode", 21, 1), ("verify", 17, 5)],
)
@pytest.mark.parametrize("family", PARITY)
def test_graph_logits_match_transformers(family_engines, checkpoints, family, graph, start, length):
    """Each compiled graph, after the prefix went through the package's own prefill,
    gives transformers' logits for its rows (positions past Gemma's window included)."""
    runner = family_engines(family).target
    g = torch.Generator().manual_seed(start + length)
    history = torch.randint(0, runner.vocab_size, (start + length,), generator=g).tolist()
    want = reference_logits(load_reference(checkpoints[family]), history)[start:]
    reset_caches(runner)
    if start:
        runner.forward(history[:start], 0)
    tokens = torch.tensor([history[start:]])
    got = runner.graphs[graph](tokens, torch.arange(start, start + length), runner.caches)[0]
    if graph == "prefill":  # its last row only
        want = want[-1:]
    assert got.shape == want.shape == (len(want), runner.vocab_size)
    assert _rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("family", PARITY)
def test_greedy_matches_transformers(family_engines, checkpoints, family):
    """32 greedy tokens from the package equal transformers' greedy continuation."""
    engine = family_engines(family)
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 16  # crosses the window and a prefill chunk
    got = engine.generate(ids, GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True))
    assert got.token_ids == reference_greedy(load_reference(checkpoints[family]), ids, N_GREEDY)


@pytest.mark.parametrize("family", EAGER_PARITY)
def test_eager_model_matches_transformers(checkpoints, family):
    """The families whose differences are outside the compiled graphs' concerns (NoPE layers,
    multipliers, RoPE tables and pairs, norms in other places, the mixtures of experts'
    routers: softmax, sigmoid, DeepSeek-V3's by groups, ERNIE 4.5's biased softmax): the
    model's logits over a history and its 32 greedy tokens, decoded step by step on its KV
    cache, equal transformers'."""
    eager = EagerModel(checkpoints[family], 96)
    reference = load_reference(checkpoints[family])
    history = torch.randint(0, eager.config.vocab_size, (40,), generator=torch.Generator()).tolist()
    assert _rel_err(eager.forward(history, 0), reference_logits(reference, history)) < FP32_TOL
    assert eager.greedy(history[:20], N_GREEDY) == reference_greedy(
        reference, history[:20], N_GREEDY
    )


def test_longrope_takes_the_factors_of_the_package_context(tmp_path):
    """LongRoPE with an original context of 16: a package of up to 16 tokens rotates with the
    short factors, a longer one with the long factors (and the attention gain, here 1.46),
    as transformers does for a sequence of that length; each is wrong for the other."""
    path = make_family_checkpoint(tmp_path / "phi3-longrope", "phi3-longrope")
    reference = load_reference(path)
    ckpt = open_checkpoint(path)
    history = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for max_seq_len, length in ((16, 14), (96, 40)):
        cfg = for_context(ModelConfig.from_hf(ckpt.config), max_seq_len)
        assert cfg.long_context == (max_seq_len > 16)
        for long in (False, True):
            model = load_model(
                replace(cfg, long_context=long), ckpt.load_weights(), 104, torch.float32
            )
            with torch.no_grad():
                ids, positions = torch.tensor([history[:length]]), torch.arange(length)
                logits[long] = model(ids, positions, new_kv_cache(cfg, 104))[0]
        want = reference_logits(reference, history[:length])
        assert _rel_err(logits[cfg.long_context], want) < FP32_TOL
        assert _rel_err(logits[not cfg.long_context], want) > 100 * FP32_TOL


@pytest.mark.skipif(not HAVE_ONNX, reason="needs the aotgen[onnx] extra")
@pytest.mark.parametrize("family", PARITY)
def test_onnx_graphs_match_aoti_and_transformers(family_engines, checkpoints, project, family):
    """Each ONNX graph through ONNX Runtime gives the AOTInductor graph's logits and
    transformers' (same fp32 math in another order: within FP32_TOL of both), and greedy
    generation through ONNX Runtime gives the AOTInductor package's tokens: past the ring's
    length where the family has sliding layers (their ring is the ONNX graphs' cache too)."""
    aoti = family_engines(family)
    ort = Engine.load(_package(family, checkpoints, project), backend="onnxruntime")
    ring = ort.manifest["models"]["target"]["kv_cache"].get("ring")
    windowed = ("gemma2", "gemma3", "phi3", "gpt-oss")
    assert ring == ({"cells": 24, "window": 8} if family in windowed else None)
    gen = torch.Generator().manual_seed(0)
    history = torch.randint(0, aoti.target.vocab_size, (20,), generator=gen).tolist()
    want = reference_logits(load_reference(checkpoints[family]), history)
    for graph, start, length in [("prefill", 0, 14), ("verify", 14, 5), ("decode", 19, 1)]:
        got = {}
        for name, engine in (("aoti", aoti), ("ort", ort)):
            runner = engine.target
            if start == 0:
                reset_caches(runner)
            tokens = torch.tensor([history[start : start + length]])
            positions = torch.arange(start, start + length)
            got[name] = runner.graphs[graph](tokens, positions, runner.caches)[0]
        assert _rel_err(got["ort"], got["aoti"]) < FP32_TOL
        rows = want[start : start + length]
        assert _rel_err(got["ort"], rows[-1:] if graph == "prefill" else rows) < FP32_TOL
    ids = aoti.tokenizer.encode(PROMPT)
    cfg = GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True)
    assert ort.generate(ids, cfg).token_ids == aoti.generate(ids, cfg).token_ids


@pytest.mark.slow  # more builds, ~100 s each on 2 cores
@pytest.mark.parametrize("family", INT8_FAMILIES)
def test_int8_fused_build_stays_close(family_engines, checkpoints, family):
    """int8 weights + fused linears on the biased families, gpt-oss (int8 experts in packed
    panels, through the kernel in every graph), LFM2 and DeepSeek-V3 (its kv_b_proj
    int8 rows, reduced in the verify graph): logits within int8's error of transformers, and
    the same argmax at nearly every position of a teacher-forced text."""
    engine = family_engines(family, **INT8)
    ids = engine.tokenizer.encode(PROMPT + " Paris is the capital of France.")
    reset_caches(engine.target)
    got = engine.target.forward(ids, 0, all_logits=True)
    want = reference_logits(load_reference(checkpoints[family]), ids)
    assert _rel_err(got, want) < INT8_TOL
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    if family == "gpt-oss":  # the experts int8 (their biases float), the routers float
        entry = engine.manifest["models"]["target"]["quantization"]
        assert entry["experts"]["scheme"] == "int8"
        assert "model.layers.0.mlp.gate" in entry["kept_float"]
        assert engine.target.weights["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.int8
    if family == "lfm2":  # the convolutions' projections int8
        kinds = {(n.split(".weight")[0], w.dtype) for n, w in engine.target.weights.items()}
        assert ("model.layers.0.conv.in_proj", torch.int8) in kinds
        assert ("model.layers.0.conv.conv", torch.float32) in kinds
    if family == "deepseek-v3":
        entry = engine.manifest["models"]["target"]["quantization"]
        assert entry["quantized"]["model.layers.0.self_attn.kv_b_proj"] == "int8 per row"
        codes = engine.target.weights["model.layers.0.self_attn.kv_b_proj.codes"]
        assert codes.dtype == torch.int8


def test_windowed_tree_and_batched_graphs_match_transformers(family_engines, checkpoints, project):
    """Sliding-window layers in a ring of window + 16 cells (a prefill chunk): the tree graph's
    nodes and the batched graphs' sequences, at positions past Gemma 3's window (8) and past
    the ring's length (24), give transformers' logits for each row's own history."""
    reference = load_reference(checkpoints["gemma3"])
    runner = family_engines("gemma3", **WINDOWED).target
    assert runner.caches[0].shape[2] == 24 < runner.caches[-1].shape[2]  # layer 3 is global
    batch = BatchEngine.load(_package("gemma3", checkpoints, project, **WINDOWED)).target
    _check_tree_and_batched_graphs(runner, batch, reference, 45, (53, 13))


def _check_tree_and_batched_graphs(runner, batch, reference, prompt_len, lengths) -> None:
    """The tree graph's nodes after a prompt of `prompt_len`, and the batched graphs'
    sequences of `lengths` in cache rows 1 and 0, against transformers' logits."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, runner.vocab_size, (prompt_len,), generator=g).tolist()
    tree = make_tree(SHAPES["bushy"][: WINDOWED["tree_nodes"] - 1], 2, runner.vocab_size)
    reset_caches(runner)
    runner.forward(prompt, 0)
    got = runner.tree_forward(tree, len(prompt))
    for node in range(len(tree)):
        history = prompt + [tree.tokens[i] for i in path_to(tree, node)]
        want = reference_logits(reference, history)[-1]
        assert _rel_err(got[node], want) < FP32_TOL, node
    histories = [torch.randint(0, runner.vocab_size, (n,), generator=g).tolist() for n in lengths]
    slots = torch.tensor([1, 0])
    for graph, t in (("batch_decode", 1), ("batch_verify", 5)):
        reset_caches(batch)
        for history, slot in zip(histories, slots.tolist(), strict=True):
            batch.forward(history[:-t], 0, slot=slot)
        tokens = torch.tensor([h[-t:] for h in histories])
        positions = torch.tensor([range(len(h) - t, len(h)) for h in histories])
        got = batch.batch(graph, tokens, positions, slots)
        for row, history in zip(got, histories, strict=True):
            assert _rel_err(row, reference_logits(reference, history)[-t:]) < FP32_TOL, graph


def test_ring_cache_generates_and_reuses_like_transformers(family_engines, checkpoints, project):
    """Gemma 3 in a ring cache: greedy text, plain, with n-gram speculation (rejected rows
    left in the ring), a draft on the target's ring and a tree of its proposals, equals
    transformers' past the ring's length; the next chat turn reuses the row; a prompt that
    branches further back than the ring holds runs from the start and still equals
    transformers; the batch engine copies a running request's ring."""
    reference = load_reference(checkpoints["gemma3"])
    engine = family_engines("gemma3", **WINDOWED)
    assert engine.manifest["models"]["target"]["kv_cache"]["ring"] == {"cells": 24, "window": 8}
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, engine.target.vocab_size, (30,), generator=g).tolist()
    want = reference_greedy(reference, prompt, 40)
    for lookup, tree in ((None, None), ("ngram", None), ("draft", None), ("draft", TreeParams())):
        cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True, speculative=lookup, tree=tree)
        assert engine.generate(prompt, cfg).token_ids == want
        turn = [*prompt, *want, 5, 6, 7]
        got = engine.generate(turn, replace(cfg, max_new_tokens=8))
        assert got.cached_tokens >= len(prompt) + len(want) - 1
        assert got.token_ids == reference_greedy(reference, turn, 8)
        branch = prompt[:20] + [9]
        got = engine.generate(branch, replace(cfg, max_new_tokens=8))
        assert got.cached_tokens == 0  # the ring no longer holds positions 13..19
        assert got.token_ids == reference_greedy(reference, branch, 8)

    batch = BatchEngine.load(engine.root)
    prompts = [prompt, prompt[:20], [*prompt, *want[:10]]]
    results = batch.generate_many(prompts, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == [reference_greedy(reference, p, 24) for p in prompts]
    assert results[1].cached_tokens == 19  # copied from the first request's row


def test_latent_cache_through_every_kind_of_call(family_engines, checkpoints, project):
    """DeepSeek-V3's latent cache (model/mla.py): the tree graph's nodes and the batched
    graphs' sequences (cache rows by slot) give transformers' logits; greedy text plain, with
    n-gram speculation, a draft of its first two layers on its cache and a tree of the draft's
    proposals equals transformers', the next turn reusing the cached rows; the batch engine's
    requests too."""
    reference = load_reference(checkpoints["deepseek-v3"])
    engine = family_engines("deepseek-v3", **WINDOWED)
    runner = engine.target
    assert [c.shape[-1] for c in runner.caches[:2]] == [48, 0]  # the latent row, no values
    batch = BatchEngine.load(engine.root)
    _check_tree_and_batched_graphs(runner, batch.target, reference, 30, (41, 13))
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, runner.vocab_size, (30,), generator=g).tolist()
    want = reference_greedy(reference, prompt, 32)
    for lookup, tree in ((None, None), ("ngram", None), ("draft", None), ("draft", TreeParams())):
        cfg = GenerationConfig(max_new_tokens=32, ignore_eos=True, speculative=lookup, tree=tree)
        assert engine.generate(prompt, cfg).token_ids == want
        turn = [*prompt, *want, 5, 6, 7]
        got = engine.generate(turn, replace(cfg, max_new_tokens=8))
        assert got.cached_tokens >= len(prompt) + len(want) - 1
        assert got.token_ids == reference_greedy(reference, turn, 8)
    prompts = [prompt, prompt[:20], [*prompt, *want[:10]]]
    results = batch.generate_many(prompts, GenerationConfig(max_new_tokens=16, ignore_eos=True))
    assert [r.token_ids for r in results] == [reference_greedy(reference, p, 16) for p in prompts]


def test_biased_q_k_v_are_fused(checkpoints, project, family_engines):
    """fuse_linears concatenates biases: Qwen2's q/k/v run as one linear."""
    family_engines("qwen2-tied")
    import json

    path = _package("qwen2-tied", checkpoints, project)
    manifest = json.loads((path / "manifest.json").read_text())
    weights = manifest["models"]["target"]["weights"]
    names = set(weights.get("aliases", {}))
    from safetensors import safe_open

    with safe_open(str(path / weights["file"]), "pt") as f:
        names |= set(f.keys())
    assert any("q_proj_k_proj_v_proj.bias" in n for n in names), sorted(names)[:20]


@pytest.mark.parametrize("family", list(SPEC_PAIRS))
def test_separate_draft_speculative_greedy_equals_plain(family_engines, family):
    """A smaller checkpoint of the same family and tokenizer as the draft, in one package
    with its target: speculative greedy output equals plain greedy for several k."""
    engine = family_engines(family)
    assert engine.draft is not None
    draft_cfg, target_cfg = engine.draft.config, engine.target.config
    assert draft_cfg["architecture"] == target_cfg["architecture"]
    assert draft_cfg["hidden_size"] < target_cfg["hidden_size"]
    ids = engine.tokenizer.encode(PROMPT)
    plain = engine.generate(ids, GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True))
    for k in (1, 3, 4):
        cfg = GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True, speculative="draft", k=k)
        spec = engine.generate(ids, cfg)
        assert spec.token_ids == plain.token_ids, k
        assert spec.spec.drafted > 0


@pytest.mark.skipif(not HAVE_ONNX, reason="needs the aotgen[onnx] extra")
@pytest.mark.parametrize("family", list(SPEC_PAIRS))
def test_separate_draft_through_onnx_runtime(family_engines, checkpoints, project, family):
    """The separate draft's own ONNX prefill and decode graphs, on its own cache: draft
    speculation through ONNX Runtime gives the AOTInductor package's plain greedy tokens."""
    ort = Engine.load(_package(family, checkpoints, project), backend="onnxruntime")
    assert set(ort.draft.graphs) == {"prefill", "decode"} and not ort.draft.shares_cache
    ids = ort.tokenizer.encode(PROMPT)
    plain = family_engines(family).generate(
        ids, GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True)
    )
    cfg = GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True, speculative="draft", k=3)
    spec = ort.generate(ids, cfg)
    assert spec.token_ids == plain.token_ids
    assert spec.spec.drafted > 0


# ---- tensor-parallel plans (no compile) ------------------------------------------------


def _eager(checkpoints: dict[str, Path], family: str):
    from aotgen.checkpoint.hf import open_checkpoint

    ckpt = open_checkpoint(checkpoints[family])
    cfg = ModelConfig.from_hf(ckpt.config)
    return load_model(cfg, ckpt.load_weights(), 32, torch.float32)


def test_gptneox_tp_shards_whole_heads(checkpoints):
    model = _eager(checkpoints, "gptneox-parallel")
    styles = resolve_plan(model, parse_parallel({"tensor": 2}))
    r1 = shard_model(model, styles, 1, 2, "0")
    full, part = dict(model.named_parameters()), dict(r1.named_parameters())
    assert set(part) == set(full)
    qkv = "gpt_neox.layers.0.attention.query_key_value."
    # 4 heads of 16: rank 1 holds heads 2 and 3, each with its q, k and v rows.
    assert torch.equal(part[qkv + "weight"], full[qkv + "weight"][96:])
    assert torch.equal(part[qkv + "bias"], full[qkv + "bias"][96:])
    dense = "gpt_neox.layers.0.attention.dense."
    assert torch.equal(part[dense + "weight"], full[dense + "weight"][:, 32:])
    assert not part[dense + "bias"].any()  # the row-parallel bias is added on rank 0 only
    with pytest.raises(RecipeError, match="does not divide num_attention_heads=4"):
        resolve_plan(model, parse_parallel({"tensor": 3}))


@pytest.mark.parametrize(
    "family",
    [
        *("qwen2-tied", "qwen3", "gemma2", "gemma3", "phi3", "granite", "glm4", "ernie4_5"),
        *("helium", "ministral"),
    ],
)
def test_llama_layout_families_have_default_tp_plans(checkpoints, family):
    model = _eager(checkpoints, family)
    styles = resolve_plan(model, parse_parallel({"tensor": 2}))
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    with pytest.raises(RecipeError, match="does not divide"):
        resolve_plan(model, parse_parallel({"tensor": 3}))


@pytest.mark.parametrize(
    "family",
    [
        *("phi", "phi-qk", "starcoder2", "cohere2", "nemotron", "arcee"),
        *("seed-oss", "ministral3", "hunyuan", "apertus", "olmo", "vaultgemma"),
    ],
)
def test_sharded_ranks_give_the_unsharded_logits(checkpoints, family, monkeypatch):
    """Phi, StarCoder2, Cohere2, Nemotron, Arcee, Seed-OSS, Ministral 3, Hunyuan, Apertus,
    OLMo 1 (clipped q/k/v) and VaultGemma sharded two ways by their default plans (a
    row-parallel bias on rank 0 only): the two ranks, run in lockstep on threads whose
    all-reduces meet at a barrier, give the unsharded model's logits."""
    model = _eager(checkpoints, family)
    styles = resolve_plan(model, parse_parallel({"tensor": 2}))
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    ranks = [shard_model(model, styles, r, 2, "0") for r in range(2)]
    barrier, parts, local = threading.Barrier(2), [None, None], threading.local()

    def all_reduce(t: torch.Tensor, op: str, group: str) -> torch.Tensor:
        parts[local.rank] = t
        barrier.wait()
        total = parts[0] + parts[1]
        barrier.wait()  # both have read before either writes again
        return total

    monkeypatch.setattr(tp.funcol, "all_reduce", all_reduce)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator())
    pos = torch.arange(12)
    out: list[torch.Tensor | None] = [None, None]

    def run(rank: int) -> None:
        local.rank = rank
        cache = new_kv_cache(tp.rank_config(model.config, 2), 32)
        out[rank] = ranks[rank](ids, pos, cache)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    want = model(ids, pos, new_kv_cache(model.config, 32))
    assert torch.equal(out[0], out[1])
    assert _rel_err(out[0][0], want[0]) < FP32_TOL


@pytest.mark.parametrize("family", ["stablelm", "cohere"])
def test_per_head_qk_norms_refuse_tensor_parallel(checkpoints, family):
    with pytest.raises(RecipeError, match="weight per head"):
        resolve_plan(_eager(checkpoints, family), parse_parallel({"tensor": 2}))


def test_attention_sinks_refuse_tensor_parallel(checkpoints):
    """Granite SWA's sink logits are per head; a plan the user gives cannot shard them."""
    plan = {"tensor": 2, "plan": {"*.q_proj": "colwise"}}
    with pytest.raises(RecipeError, match="attention sinks"):
        resolve_plan(_eager(checkpoints, "granite-swa"), parse_parallel(plan))


def test_olmo2_refuses_tensor_parallel(checkpoints):
    """OLMo 2 normalises q and k across all heads: a rank with some of them cannot."""
    with pytest.raises(RecipeError, match="normalises q and k across all heads"):
        resolve_plan(_eager(checkpoints, "olmo2"), parse_parallel({"tensor": 2}))


# ---- config.json: both dialects, and keys the model cannot honour -----------------------

BASE_HF = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
}


def test_transformers4_pythia_config():
    cfg = ModelConfig.from_hf(
        {
            **BASE_HF,
            "architectures": ["GPTNeoXForCausalLM"],
            "rotary_pct": 0.25,
            "rotary_emb_base": 10000,
            "use_parallel_residual": True,
            "layer_norm_eps": 1e-5,
            "hidden_act": "gelu",
        }
    )
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.attention_bias) == (4, 10000.0, True)


def test_transformers4_gemma3_config():
    cfg = ModelConfig.from_hf(
        {
            **BASE_HF,
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 32,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    )
    assert [cfg.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.sliding_window) == (1e6, 1e4, 512)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.tie_word_embeddings  # Gemma's default


@pytest.mark.parametrize(
    "arch, rotary_dim",
    [("PhiForCausalLM", 8), ("StableLmForCausalLM", 4), ("Starcoder2ForCausalLM", None)],
)
def test_layernorm_decoders_default_rotary_factor(arch, rotary_dim):
    """Without partial_rotary_factor, transformers rotates half of Phi's head (16 dims here),
    a quarter of StableLM's, all of StarCoder2's."""
    assert ModelConfig.from_hf({**BASE_HF, "architectures": [arch]}).rotary_dim == rotary_dim


@pytest.mark.parametrize("pattern, last", [(4, "sliding_attention"), ("LLLG", "full_attention")])
def test_exaone4_window_pattern(pattern, last):
    """EXAONE 4's pattern as a period or as letters (then the last layer is global, as
    transformers 4.x read it): three sliding layers in four, only they rotated."""
    cfg = ModelConfig.from_hf(
        {
            **BASE_HF,
            "architectures": ["Exaone4ForCausalLM"],
            "sliding_window": 16,
            "sliding_window_pattern": pattern,
        }
    )
    local = [True, True, True, False, True, last == "sliding_attention"]
    assert [cfg.is_sliding(i) for i in range(6)] == local
    assert cfg.rope_layers == tuple(local)


def test_transformers4_glm4_config():
    """GLM-4-0414's config.json as transformers 4.x saved it."""
    cfg = ModelConfig.from_hf(
        {
            **BASE_HF,
            "architectures": ["Glm4ForCausalLM"],
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
            "attention_bias": True,
            "rms_norm_eps": 1e-5,
        }
    )
    assert (cfg.rotary_dim, cfg.attention_bias, cfg.four_norms, cfg.gemma) == (
        16,
        True,
        True,
        False,
    )


YARN_8 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
BETA = {"llama_4_scaling_beta": 0.1}  # Ministral 3's only
# DeepSeek-V3's routing: 8 experts, 2 a token.
DEEPSEEK = {"n_routed_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    "arch,extra,key",
    [
        ("LlamaForCausalLM", {"hidden_act": "relu"}, "hidden_act"),
        ("LlamaForCausalLM", {"sliding_window": 4096}, "sliding_window"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 4}}, "dynamic"),
        ("Qwen3ForCausalLM", {"rope_scaling": {"type": "yarn", "factor": 4}}, "needs original_max"),
        ("Qwen2ForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("GPTNeoXForCausalLM", {"hidden_act": "relu"}, "hidden_act"),
        ("Phi3ForCausalLM", {"rope_scaling": {"type": "su"}}, "rope_scaling type 'su'"),
        ("SmolLM3ForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
        ("SmolLM3ForCausalLM", {"no_rope_layers": [1]}, "no_rope_layers must name every"),
        ("GraniteForCausalLM", {"logits_scaling": 0}, "logits_scaling must be a positive"),
        ("FalconForCausalLM", {}, "unsupported architecture 'FalconForCausalLM'"),
        ("PhiForCausalLM", {"hidden_act": "relu"}, "hidden_act='relu'"),
        ("StableLmForCausalLM", {"partial_rotary_factor": 0.1}, "odd or empty dim"),
        ("Starcoder2ForCausalLM", {"norm_epsilon": 0}, "norm_epsilon must be a positive"),
        ("GemmaForCausalLM", {"use_bidirectional_attention": True}, "causal attention only"),
        ("CohereForCausalLM", {"logit_scale": -1}, "logit_scale must be a positive"),
        ("Cohere2ForCausalLM", {"layer_types": ["chunked"] * 6}, "layer_types"),
        ("Cohere2ForCausalLM", {"sliding_window_pattern": "every 4"}, "sliding_window_pattern"),
        ("Cohere2ForCausalLM", {"use_qk_norm": True}, "use_qk_norm"),
        ("NemotronForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("ArceeForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("MixtralForCausalLM", {**MOE, "num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ("Qwen3MoeForCausalLM", {**MOE, "hidden_act": "gelu"}, "SwiGLU"),
        ("OlmoeForCausalLM", {**MOE, "clip_qkv": -8.0}, "clip_qkv must be a positive"),
        ("Qwen2MoeForCausalLM", {**MOE, "use_sliding_window": True}, "use_sliding_window"),
        ("GraniteMoeHybridForCausalLM", {"layer_types": ["mamba"] * 6}, "Mamba layers"),
        ("GraniteMoeHybridForCausalLM", {}, "Mamba layers"),
        ("Ernie4_5ForCausalLM", {"use_bias": True}, "use_bias=True"),
        ("Ernie4_5ForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("SeedOssForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("MinistralForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("Ministral3ForCausalLM", {"rope_parameters": YARN_8}, "llama_4_scaling_beta"),
        ("MistralForCausalLM", {"rope_parameters": {**YARN_8, **BETA}}, "llama_4_scaling_beta"),
        ("HunYuanDenseV1ForCausalLM", {"use_cla": True}, "use_cla"),
        ("Glm4MoeForCausalLM", {**DEEPSEEK, "n_group": 3}, "split the experts evenly"),
        ("Glm4MoeForCausalLM", {**DEEPSEEK, "n_group": 4, "topk_group": 5}, "topk_group"),
        ("Dots1ForCausalLM", {**DEEPSEEK, "n_group": 4, "num_experts_per_tok": 3}, "kept groups"),
        ("Dots1ForCausalLM", {**DEEPSEEK, "scoring_func": "softmax"}, "scoring_func"),
        ("Glm4MoeForCausalLM", {**DEEPSEEK, "routed_scaling_factor": 0}, "routed_scaling"),
        ("ExaoneMoeForCausalLM", {**MOE, "mlp_layer_types": ["moe"] * 6}, "mlp_layer_types"),
        ("Ernie4_5_MoeForCausalLM", {"moe_layer_interval": 0}, "moe_layer_interval"),
        (
            "GraniteSWAForCausalLM",
            {
                "layer_types": ["full_attention"] * 6,
                "layer_rope_theta": [1e4, 2e4, 1e4, 1e4, 1e4, 1e4],
            },
            "more than one base",
        ),
        ("GraniteSWAForCausalLM", {"layer_rope_theta": [1e4] * 3}, "layer_rope_theta must name"),
        (
            "OlmoHybridForCausalLM",
            {"linear_num_key_heads": 2, "linear_num_value_heads": 4},
            "must equal linear_num_key_heads",
        ),
        (
            "MellumForCausalLM",
            {
                **MOE,
                "sliding_window": 8,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                },
            },
            "sliding_attention 'linear'",
        ),
        ("HunYuanMoEV1ForCausalLM", {"num_experts": 8, "moe_topk": [2, 3]}, "moe_topk differs"),
        ("HunYuanMoEV1ForCausalLM", {"num_experts": 8, "moe_topk": 2, "use_cla": True}, "use_cla"),
        (
            "HunYuanMoEV1ForCausalLM",
            {"num_experts": 8, "moe_topk": 2, "moe_intermediate_size": [64] * 6},
            "intermediate_size wide",
        ),
        ("Ernie4_5_MoeForCausalLM", {"moe_k": 9, "moe_num_experts": 8}, "num_experts_per_tok=9"),
        ("Ernie4_5_MoeForCausalLM", {"use_bias": True}, "use_bias"),
        ("LlamaForCausalLM", {"hidden_act": "xielu"}, "xielu"),
        ("DeepseekV2ForCausalLM", {"num_experts_per_tok": 2, "topk_method": "noaux_tc"}, "noaux"),
        ("DeepseekV2ForCausalLM", {"num_experts_per_tok": 2, "norm_topk_prob": True}, "norm_topk"),
        ("DeepseekV2ForCausalLM", {"num_experts_per_tok": 2, "moe_layer_freq": 2}, "moe_layer_f"),
        ("DeepseekV2ForCausalLM", {}, "num_experts_per_tok=0"),  # transformers' default: None
        ("DeepseekV3ForCausalLM", {"topk_method": "greedy"}, "topk_method='greedy'"),
        ("DeepseekV3ForCausalLM", {"qk_rope_head_dim": 15}, "qk_rope_head_dim=15 must be even"),
        ("DeepseekV3ForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("YoutuForCausalLM", {"kv_lora_rank": None}, "kv_lora_rank must be a positive"),
        (
            "HunYuanDenseV1ForCausalLM",
            {"rope_scaling": {"type": "dynamic", "factor": 2}},
            "dynamic",
        ),
    ],
)
def test_unhonoured_config_keys_are_errors(arch, extra, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf({**BASE_HF, "architectures": [arch], **extra})


def test_qwen_ignores_inactive_sliding_window():
    """Qwen configs carry sliding_window with use_sliding_window false: not an error."""
    hf = {**BASE_HF, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 131072}
    cfg = ModelConfig.from_hf({**hf, "use_sliding_window": False})
    assert cfg.sliding_window is None and cfg.attention_bias


# ---- int4 and GPTQ on the biased families: the passes on the exported graph, run eagerly --


@pytest.mark.slow  # GPTQ calibrates over the whole calibration text: ~3 min for the four
@pytest.mark.parametrize("family", ["qwen2-tied", "gptneox-parallel"])
@pytest.mark.parametrize(
    "quantize",
    [
        {"linear": {"int4": {"groupsize": 32}}},
        {"linear": {"int4": {"groupsize": 32}}, "method": "gptq"},
    ],
    ids=["int4", "gptq-int4"],
)
def test_int4_and_gptq_passes_on_biased_families(checkpoints, family, quantize):
    """fuse_linears then int4 (round to nearest or GPTQ) on a prefill-shaped graph, biases kept:
    close to the float model."""
    from aotgen.export.aoti import calibration_spec, export_graph
    from aotgen.model.llama import new_kv_cache
    from aotgen.package.models import ModelBuild
    from aotgen.package.models import calibrate as _calibrate
    from aotgen.passes.fuse import FuseLinearsPass
    from aotgen.passes.quantize import QuantizePass
    from aotgen.passes.quantize_options import parse_quantize
    from aotgen.runtime.tokenizer import Tokenizer

    model = _eager(checkpoints, family)
    cfg = model.config
    spec = calibration_spec(16)  # the prefill graph with every row's logits
    passes = [FuseLinearsPass(), QuantizePass(parse_quantize(quantize))]
    if quantize.get("method") == "gptq":
        recipe = parse_recipe(
            {"checkpoint": str(checkpoints[family]), **RECIPE, "quantize": quantize}, "q", Path(".")
        )
        mb = ModelBuild("target", model, cfg, [spec], passes)
        _calibrate(mb, recipe, Tokenizer.from_dir(checkpoints[family]))
    ep = export_graph(model, spec, new_kv_cache(cfg, 32))
    for graph_pass in passes:
        ep = graph_pass(ep)
    g = torch.Generator().manual_seed(0)
    tokens, pos = torch.randint(0, cfg.vocab_size, (1, 12), generator=g), torch.arange(12)
    with torch.no_grad():
        got = ep.module()(tokens, pos, new_kv_cache(cfg, 32))
        want = model(tokens, pos, new_kv_cache(cfg, 32))
    # int4 g32 of random Gaussian weights (no structure to keep): measured 0.087-0.099.
    assert 0 < _rel_err(got, want) < 0.2


@pytest.mark.cpp
def test_cpp_runtime_on_a_ring_cache(run_bin, batch_bin, family_engines, tmp_path):  # noqa: F811
    """The C++ runtime on Gemma 3's ring cache (`cpp_matches_python_on_a_ring`)."""
    cpp_matches_python_on_a_ring(run_bin, batch_bin, family_engines("gemma3", **WINDOWED), tmp_path)


def cpp_matches_python_on_a_ring(
    run_exe: Path, batch_exe: Path, engine: Engine, tmp_path: Path
) -> None:
    """aotgen-run's greedy and n-gram ids equal Python's; aotgen-batch on one slot, a chat's
    next turn and a branch from further back than the ring holds, gets Python's ids and
    cached counts (the branch runs whole in both)."""
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, engine.target.vocab_size, (30,), generator=g).tolist()
    for args in ([], ["--lookup", "ngram"]):
        cfg = GenerationConfig(
            max_new_tokens=40, ignore_eos=True, speculative="ngram" if args else None
        )
        got = cpp_generate(
            run_exe, engine.root, prompt, "--max-new-tokens", "40", "--ignore-eos", *args
        )
        assert got["ids"] == engine.generate(prompt, replace(cfg, reuse_prefix=False)).token_ids
    first = engine.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    prompts = [prompt, [*prompt, *first.token_ids, 5, 6], [*prompt[:20], 9]]
    configs = [GenerationConfig(n, ignore_eos=True) for n in (40, 8, 8)]
    want = BatchEngine.load(engine.root, slots=1).generate_many(prompts, configs)
    requests = [request_json(p, c) for p, c in zip(prompts, configs, strict=True)]
    got = cpp_results(run_batch(batch_exe, engine.root, requests, tmp_path, "--slots", "1"))[0]
    assert [r["ids"] for r in got] == [w.token_ids for w in want]
    assert [r["cached_tokens"] for r in got] == [w.cached_tokens for w in want]
    assert want[1].cached_tokens >= 69 and want[2].cached_tokens == 0


@pytest.mark.cpp
@pytest.mark.parametrize("family", PARITY)
def test_cpp_runtime_runs_every_family(run_bin, family_engines, family):  # noqa: F811
    """The C++ runtime needs no model code either: the same package, the same greedy ids."""
    engine = family_engines(family)
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate(ids, GenerationConfig(max_new_tokens=N_GREEDY, ignore_eos=True))
    got = cpp_generate(run_bin, engine.root, ids, "--max-new-tokens", str(N_GREEDY), "--ignore-eos")
    assert got["ids"] == want.token_ids
