"""The vertical slice on a tiny model: compiled graphs vs the eager reference, package
format, rebuild no-op, and every bad input the issue lists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from reference import EagerModel, reset_caches

from aotgen.checkpoint.hf import CheckpointError
from aotgen.package import build as build_mod
from aotgen.package import compile as compile_mod
from aotgen.package.manifest import PackageError, verify_package
from aotgen.recipe import VERIFY_ROOM, RecipeError, parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError
from aotgen.runtime.model_runner import zeros_on_demand

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    # Longer than one prefill chunk (16 tokens): exercises chunked prefill.
    "Speculative decoding drafts tokens and verifies them in one pass. Ahead-of-time "
    "compilation turns a checkpoint into a package. 1 2 3 4 5 6 7 8 9 10",
]


@pytest.fixture(scope="module")
def engine(tiny_package) -> Engine:
    return Engine.load(tiny_package)


@pytest.fixture(scope="module")
def eager(tiny_checkpoint, engine) -> EagerModel:
    return EagerModel(tiny_checkpoint, engine.target.cache_len)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "graph,length,start",
    [("prefill", 11, 0), ("prefill", 16, 5), ("decode", 1, 7), ("verify", 5, 9)],
)
def test_graph_logits_match_eager(engine, eager, graph, length, start):
    """Each compiled graph, on the same cache state, gives the eager logits (fp32 < 1e-4)."""
    runner = engine.target
    got, want = _graph_and_eager(runner, eager, graph, length, start)
    assert _rel_err(got, want) < 1e-4
    for c_got, c_want in zip(runner.caches, eager.caches, strict=True):
        assert _rel_err(c_got[:, :, : start + length], c_want[:, :, : start + length]) < 1e-4


def _graph_and_eager(runner, eager, graph: str, length: int, start: int):
    """The logits of one call of `graph` at positions start.. and the eager model's, after
    both prefilled the same random history into zeroed caches."""
    g = torch.Generator().manual_seed(length + start)
    history = torch.randint(0, runner.vocab_size, (start + length,), generator=g).tolist()
    reset_caches(runner)
    for c in eager.caches:
        c.zero_()
    if start:  # fill the cache identically through the prefill path
        runner.forward(history[:start], 0)
        eager.forward(history[:start], 0)
    tokens = torch.tensor([history[start:]])
    pos = torch.arange(start, start + length)
    got = runner.graphs[graph](tokens, pos, runner.caches)[0].float()
    want = eager.forward(history[start:], start)
    if graph == "prefill":  # its last row only
        want = want[-1:]
    assert got.shape == want.shape == (len(want), runner.vocab_size)
    return got, want


def test_bfloat16_package_matches_eager(tied_checkpoint, project):
    """`dtype: bfloat16` (bfloat16 panels, or where the CPU's bfloat16 matmul measured faster
    reductions for one row and oneDNN for several) against the float32 eager model, within
    bfloat16 rounding."""
    raw = {"checkpoint": str(tied_checkpoint), **TINY_RECIPE, "dtype": "bfloat16"}
    package = build_mod.build(parse_recipe(raw, "tiny-bf16", Path(".")), project).path
    packed = verify_package(package)["models"]["target"]["packed_linears"]
    tiles = [t for t in packed["tiles"] if t["kind"] == "bfloat16"]
    assert tiles  # measured against F.linear in bfloat16 ...
    several = [(t["n"], t["k"], t["us"] > t["blas_us"]) for t in tiles if t["rows"] > 1]
    on_panels = {(n, k) for n, k, _ in several} - {(n, k) for n, k, slower in several if slower}
    assert (packed["weights"] > 0) == bool(on_panels)  # ... and packed where the panels won
    engine = Engine.load(package)
    runner = engine.target
    assert all(c.dtype == torch.bfloat16 for c in runner.caches)
    eager = EagerModel(tied_checkpoint, runner.cache_len)
    for graph, length, start in [("prefill", 11, 0), ("decode", 1, 7), ("verify", 5, 9)]:
        got, want = _graph_and_eager(runner, eager, graph, length, start)
        assert _rel_err(got, want) < 2e-2, graph  # measured 4-5e-3
    result = engine.generate([5, 6, 7], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8


@pytest.mark.parametrize("length", [2, 3, 4])
def test_few_tokens_run_padded_through_verify(engine, eager, monkeypatch, length):
    """2..verify_len-1 tokens go through the verify graph, padded: the logits of the real
    tokens, and what later steps see, equal eager (the padding's cache entries are dead)."""
    runner = engine.target
    assert 1 < length < runner.verify_len
    history = torch.randint(0, runner.vocab_size, (9 + length + 1,)).tolist()
    reset_caches(runner)
    for c in eager.caches:
        c.zero_()
    runner.forward(history[:9], 0)
    eager.forward(history[:9], 0)
    used = []
    for name in ("prefill", "verify"):
        graph = runner.graphs[name]
        monkeypatch.setitem(
            runner.graphs, name, lambda *a, g=graph, n=name, **kw: used.append(n) or g(*a, **kw)
        )
    got = runner.forward(history[9 : 9 + length], 9, all_logits=True)
    assert used == ["verify"]
    assert _rel_err(got, eager.forward(history[9 : 9 + length], 9)) < 1e-4
    nxt = 9 + length
    assert _rel_err(runner.decode(history[nxt], nxt), eager.forward([history[nxt]], nxt)[-1]) < 1e-4


def test_every_rows_logits_come_from_verify_and_decode(engine, eager, monkeypatch):
    """The prefill graph returns its last row only, so `all_logits` runs verify-sized chunks,
    and one token at a time where the verify graph would pass the cache's end: every row's
    logits still equal eager."""
    runner = engine.target
    end = runner.cache_len
    start = end - 3 * runner.verify_len - 2  # 3 verify chunks, then 2 tokens at the end
    history = torch.randint(0, runner.vocab_size, (end,), generator=torch.Generator()).tolist()
    reset_caches(runner)
    for c in eager.caches:
        c.zero_()
    runner.forward(history[:start], 0)
    eager.forward(history[:start], 0)
    used = []
    for name in ("prefill", "verify", "decode"):
        graph = runner.graphs[name]
        monkeypatch.setitem(
            runner.graphs, name, lambda *a, g=graph, n=name, **kw: used.append(n) or g(*a, **kw)
        )
    tail = history[start:]
    got = runner.forward(tail, start, all_logits=True)
    assert used == ["verify"] * 3 + ["decode"] * 2
    assert got.shape == (len(tail), runner.vocab_size)
    assert _rel_err(got, eager.forward(tail, start)) < 1e-4


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_eager(engine, eager, prompt):
    ids = engine.tokenizer.encode(prompt)
    result = engine.generate(ids, GenerationConfig(max_new_tokens=32, ignore_eos=True))
    assert len(result.token_ids) == 32
    assert result.token_ids == eager.greedy(ids, 32)
    assert result.text == engine.tokenizer.decode(result.token_ids)


def test_prompt_longer_than_chunk_is_chunked(engine):
    ids = engine.tokenizer.encode(PROMPTS[2])
    assert len(ids) > engine.target.prefill_chunk


def test_seeded_sampling_is_reproducible(engine):
    from aotgen.runtime.sampling import SamplingParams

    ids = engine.tokenizer.encode(PROMPTS[0])
    cfg = GenerationConfig(
        max_new_tokens=20,
        ignore_eos=True,
        sampling=SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3),
    )
    a, b = engine.generate(ids, cfg), engine.generate(ids, cfg)
    assert a.token_ids == b.token_ids
    other = engine.generate(
        ids,
        GenerationConfig(
            max_new_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=1.0, seed=4)
        ),
    )
    assert other.token_ids != a.token_ids


def test_stop_strings_and_streaming(engine):
    ids = engine.tokenizer.encode(PROMPTS[1])
    full = engine.generate(ids, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert len(full.text) > 6
    stop = full.text[3:6]
    pieces: list[str] = []
    cut = engine.generate(
        ids,
        GenerationConfig(max_new_tokens=24, ignore_eos=True, stop=(stop,)),
        on_text=pieces.append,
    )
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == cut.text
    assert full.stop_reason is None  # ended by its length


def test_eos_ends_generation(engine, eager):
    ids = engine.tokenizer.encode(PROMPTS[0])
    first = eager.greedy(ids, 5)
    engine.tokenizer.eos_ids.add(first[2])
    try:
        r = engine.generate(ids, GenerationConfig(max_new_tokens=20))
    finally:
        engine.tokenizer.eos_ids.discard(first[2])
    assert r.finish_reason == "eos" and r.token_ids == first[:2] and r.stop_reason is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_caches_start_as_separate_zero_tensors(engine, dtype):
    a, b = zeros_on_demand([1, 3, 64, 8], dtype), zeros_on_demand([1, 3, 64, 8], dtype)
    assert a.shape == (1, 3, 64, 8) and a.dtype == dtype and a.is_contiguous()
    a.fill_(1)
    assert b.count_nonzero() == 0 and a.sum() == a.numel()
    fresh = Engine.load(engine.root, verify=False).target.caches
    assert all(c.count_nonzero() == 0 for c in fresh)
    assert len({c.data_ptr() for c in fresh}) == len(fresh)


def test_manifest_contents(tiny_package):
    m = verify_package(tiny_package)
    assert m["torch_version"] == torch.__version__
    target = m["models"]["target"]
    assert set(target["graphs"]) == {"prefill", "decode", "verify"}
    assert target["graphs"]["verify"]["tokens"] == {"min": 5, "max": 5}
    assert target["graphs"]["prefill"]["tokens"] == {"min": 2, "max": 16}
    # verify_k + 1 = 5 positions past max_seq_len, rounded up to VERIFY_ROOM (8).
    assert target["kv_cache"]["cache_len"] == TINY_RECIPE["max_seq_len"] + VERIFY_ROOM
    files = m["files"]
    assert {"rank0/model.pt2", "rank0/target.safetensors", "tokenizer/tokenizer.json"} <= set(files)
    # Weights stored once: the package is the weights plus small compiled code.
    weights = files["rank0/target.safetensors"]["bytes"]
    assert sum(1 for f in files if f.endswith(".safetensors")) == 1
    assert weights > 0.9 * _checkpoint_bytes(m)


def _checkpoint_bytes(m: dict) -> int:
    c = m["models"]["target"]["config"]
    h, layers, v, i = (
        c["hidden_size"],
        c["num_hidden_layers"],
        c["vocab_size"],
        c["intermediate_size"],
    )
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return 4 * (layers * per_layer + v * h * (1 if c["tie_word_embeddings"] else 2) + h)


def test_unchanged_rebuild_is_a_noop(tiny_checkpoint, tiny_package, project):
    recipe = parse_recipe({"checkpoint": str(tiny_checkpoint), **TINY_RECIPE}, "tiny", Path("."))
    before = (tiny_package / "manifest.json").stat().st_mtime_ns
    report = build_mod.build(recipe, project)
    assert report.up_to_date
    assert (tiny_package / "manifest.json").stat().st_mtime_ns == before


def test_compiles_are_reused_across_builds(tiny_checkpoint, tiny_package, project, eager):
    """Another recipe with the same target takes the target's compiled graphs from the project
    cache: adding a draft compiles the draft alone, and a k up to 7 keeps the KV cache shape,
    so it compiles only the new verify graph. The package decodes exactly as the eager model."""
    for k, new in ((TINY_RECIPE["verify_k"], set()), (2, {"verify"})):
        raw = {**TINY_RECIPE, "verify_k": k, "speculative": {"draft": {"layers": 1}, "k": k}}
        recipe = parse_recipe({"checkpoint": str(tiny_checkpoint), **raw}, f"tiny-k{k}", Path("."))
        report = build_mod.build(recipe, project)
        cached = {g.graph for g in report.graphs if g.model == "target" and g.cached}
        # The new verify graph may have been compiled by another test of this session.
        assert {"prefill", "decode", "verify"} - new <= cached
    engine = Engine.load(report.path)
    ids = engine.tokenizer.encode(PROMPTS[1])
    want = eager.greedy(ids, 24)
    for mode in (None, "draft"):
        config = GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative=mode)
        assert engine.generate(ids, config).token_ids == want


def test_compile_key_names_what_the_compile_depends_on(tiny_model, tmp_path):
    """Two exports of one graph share a key; other options, thread counts, linked objects
    or graphs do not."""
    from aotgen.export.aoti import compile_key, example_inputs, export_graph, graph_specs
    from aotgen.export.aoti_runtime import runtime_object
    from aotgen.model.llama import new_kv_cache

    model, cfg, cache_len = tiny_model
    caches = new_kv_cache(cfg, cache_len)
    prefill, decode, _ = graph_specs(TINY_RECIPE["prefill_chunk"], TINY_RECIPE["verify_k"])
    args = example_inputs(decode, caches)
    key = compile_key(export_graph(model, decode, caches), args, {"max_autotune": False})
    assert compile_key(export_graph(model, decode, caches), args, {"max_autotune": False}) == key
    ep = export_graph(model, decode, caches)
    assert compile_key(ep, args, {"max_autotune": True}) != key
    assert compile_key(ep, args, {"max_autotune": False}, [runtime_object(tmp_path)]) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert compile_key(ep, args, {"max_autotune": False}) != key
    finally:
        torch.set_num_threads(threads)
    other = export_graph(model, prefill, caches)
    assert compile_key(other, example_inputs(prefill, caches), {"max_autotune": False}) != key


# ---- bad input ------------------------------------------------------------------------------


def test_unknown_recipe_key_names_valid_keys(tiny_checkpoint):
    with pytest.raises(RecipeError, match=r"unknown key\(s\) max_seq.*valid keys: .*max_seq_len"):
        parse_recipe({"checkpoint": str(tiny_checkpoint), "max_seq": 10}, "r", Path("."))


def test_prefill_chunk_fits_in_max_seq_len(tiny_checkpoint):
    """The default chunk is cut to a short max_seq_len; a chunk the recipe names must fit."""
    ckpt = str(tiny_checkpoint)
    assert parse_recipe({"checkpoint": ckpt, "max_seq_len": 64}, "r", Path(".")).prefill_chunk == 64
    fits = parse_recipe(
        {"checkpoint": ckpt, "max_seq_len": 64, "prefill_chunk": 64}, "r", Path(".")
    )
    assert fits.prefill_chunk == 64
    assert parse_recipe({"checkpoint": ckpt}, "r", Path(".")).prefill_chunk == 256
    with pytest.raises(
        RecipeError, match="prefill_chunk 65 is longer than max_seq_len 64.*at most 64"
    ):
        parse_recipe({"checkpoint": ckpt, "max_seq_len": 64, "prefill_chunk": 65}, "r", Path("."))


def _checkpoint_copy(src: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint for a test to damage."""
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def test_missing_checkpoint_file(tmp_path, tiny_checkpoint, project):
    ckpt = _checkpoint_copy(tiny_checkpoint, tmp_path)
    (ckpt / "model.safetensors").unlink()
    recipe = parse_recipe({"checkpoint": str(ckpt), **TINY_RECIPE}, "missing", Path("."))
    with pytest.raises(CheckpointError, match="missing weight file"):
        build_mod.build(recipe, project)
    assert not (project.artifacts_dir / "missing").exists()


def test_truncated_checkpoint_file(tmp_path, tiny_checkpoint, project):
    ckpt = _checkpoint_copy(tiny_checkpoint, tmp_path)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    recipe = parse_recipe({"checkpoint": str(ckpt), **TINY_RECIPE}, "truncated", Path("."))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        build_mod.build(recipe, project)
    assert not (project.artifacts_dir / "truncated").exists()


def test_broken_tokenizer_is_refused_before_the_compile(tmp_path, tiny_checkpoint, project):
    """A tokenizer.json the runtime could not load is named by the build, not by `aotgen run`."""
    ckpt = _checkpoint_copy(tiny_checkpoint, tmp_path)
    (ckpt / "tokenizer.json").write_text("{}")
    recipe = parse_recipe({"checkpoint": str(ckpt), **TINY_RECIPE}, "tok", Path("."))
    with pytest.raises(CheckpointError, match=r"tokenizer.json does not load \(Model missing"):
        build_mod.build(recipe, project)
    assert not (project.artifacts_dir / "tok").exists()


@pytest.mark.parametrize(
    "key, value", [("hidden_size", "64"), ("num_hidden_layers", 0), ("vocab_size", 320.0)]
)
def test_config_sizes_are_whole_numbers(tiny_checkpoint, key, value):
    from aotgen.model.config import ModelConfig

    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    ModelConfig.from_hf(cfg)  # the tiny config itself passes
    with pytest.raises(ValueError, match=f"config.json: {key} must be a whole number >= 1, got"):
        ModelConfig.from_hf({**cfg, key: value})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_named(tiny_checkpoint, bad):
    from aotgen.checkpoint.hf import open_checkpoint
    from aotgen.model.config import ModelConfig
    from aotgen.model.llama import load_model

    ckpt = open_checkpoint(tiny_checkpoint)
    cfg = ModelConfig.from_hf(ckpt.config)
    weights = ckpt.load_weights()
    load_model(cfg, dict(weights), 64, torch.float32)  # the tiny weights themselves pass
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name].clone()
    weights[name][3, 5] = bad
    with pytest.raises(ValueError, match=f"{name} holds NaN or infinite values"):
        load_model(cfg, weights, 64, torch.float32)


def test_unsupported_architecture(tmp_path, tiny_checkpoint, project):
    ckpt = _checkpoint_copy(tiny_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    recipe = parse_recipe({"checkpoint": str(ckpt), **TINY_RECIPE}, "mamba", Path("."))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'"):
        build_mod.build(recipe, project)


def test_prompt_beyond_context(engine):
    with pytest.raises(GenerationError, match="exceeds the package context of 160 tokens"):
        engine.generate([1] * 150, GenerationConfig(max_new_tokens=20))


def _copy_package(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(pkg: Path, fn) -> None:
    m = json.loads((pkg / "manifest.json").read_text())
    fn(m)
    (pkg / "manifest.json").write_text(json.dumps(m))


def test_other_torch_version_refused(tmp_path, tiny_package):
    pkg = _copy_package(tiny_package, tmp_path / "pkg")
    _edit_manifest(pkg, lambda m: m.update(torch_version="2.0.0"))
    with pytest.raises(PackageError, match="built with torch 2.0.0"):
        Engine.load(pkg)


def test_other_isa_refused(tmp_path, tiny_package):
    pkg = _copy_package(tiny_package, tmp_path / "pkg")
    _edit_manifest(pkg, lambda m: m["target"].update(isa="AMX_FP16"))
    with pytest.raises(PackageError, match="compiled for AMX_FP16"):
        Engine.load(pkg)


def test_hash_mismatch_refused_before_loading(tmp_path, tiny_package):
    pkg = _copy_package(tiny_package, tmp_path / "pkg")
    weights = pkg / "rank0" / "target.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="does not match its sha256"):
        Engine.load(pkg)


def test_interrupted_build_leaves_nothing(monkeypatch, tiny_checkpoint, project):
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(compile_mod, "compile_graph", interrupted)
    recipe = parse_recipe(
        {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE}, "interrupted", Path(".")
    )
    with pytest.raises(KeyboardInterrupt):
        build_mod.build(recipe, project)
    assert calls
    leftovers = [p.name for p in project.artifacts_dir.iterdir() if "interrupted" in p.name]
    assert leftovers == []


def test_cli_errors_are_one_line(tmp_path, tiny_checkpoint):
    from typer.testing import CliRunner

    from aotgen.cli import app

    runner = CliRunner()
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"checkpoint: {tiny_checkpoint}\nmax_seq: 4\n")
    cases = [
        (["build", str(tmp_path / "nope.yaml")], "recipe file not found"),
        (["build", str(bad)], "unknown key(s) max_seq"),
        (["run", str(tmp_path), "--prompt", "hi"], "is not an aotgen package"),
        (["inspect", str(tmp_path)], "is not an aotgen package"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], (args, result.output)
        assert "Traceback" not in result.output
