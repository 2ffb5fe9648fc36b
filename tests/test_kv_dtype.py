"""`kv_cache_dtype: bfloat16` or `int8` on a float32 package: the graphs write keys and values
rounded to bfloat16, or as int8 codes with a scale per row (kernels/cache_rows.py), and attend
over them in float32 (kernels/attention.cpp widens them), so every graph equals the eager
model run on a cache of that dtype (float32's bound, but for a key that rounds to the
neighbouring step); both runtimes allocate the cache at half the bytes (bfloat16) or
(head_dim + 4) / (4 head_dim) of them (int8) and generate what the eager model does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE, stop_warming
from families import RECIPE, make_family_checkpoint
from reference import EagerModel, reset_caches

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.kernels.cache_rows import row_width
from aotgen.model.config import ModelConfig
from aotgen.model.llama import new_kv_cache
from aotgen.package.build import BuildReport, build
from aotgen.package.models import recipe_kv_cache
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.sampling import SamplingParams
from tests.test_batch import _prompts, batched_and_eager
from tests.test_cpp_runtime import cpp_generate

BF16 = {"kv_cache_dtype": "bfloat16"}
# Package -> (the checkpoint it builds on: tiny, tied or gemma2, the recipe's keys); the
# background builder's `kv_dtype` warmer compiles them ahead (tests/real_builds.py).
DRAFT = {**TINY_RECIPE, "max_batch": 4, "speculative": {"draft": {"layers": 1}}}
PACKAGES = {
    "tiny-kv-bfloat16": ("tiny", {**DRAFT, "kv_cache_dtype": "bfloat16"}),
    "tiny-kv-int8": ("tiny", {**DRAFT, "kv_cache_dtype": "int8"}),
    "gemma2-bfloat16-kv": ("gemma2", {**RECIPE, "kv_cache_dtype": "bfloat16"}),
    "gemma2-int8-kv": ("gemma2", {**RECIPE, "kv_cache_dtype": "int8"}),
    "tiny-bf16-kv8": ("tied", {**TINY_RECIPE, "dtype": "bfloat16", "kv_cache_dtype": "int8"}),
}


# (mean, max) bounds on |logits - eager's on the same cache dtype|, and the mean a float32
# cache's logits exceed (the control: the bound sees the cache's rounding).
BOUNDS = {torch.bfloat16: (1e-5, 1e-3, 1e-4), torch.int8: (2e-4, 2e-3, 5e-4)}


def assert_close_on_narrow_cache(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """Logits on a bfloat16 or int8 cache against the eager model's. A key or value the graph
    computes in another float32 order (fused, packed linears) can round to the neighbouring
    bfloat16, about one element in 10^4, moving the few logits that read it by up to ~2e-4 on
    the tiny model: float32's bound on the mean, a rounding step's on the maximum. An int8
    code that flips (one in ~10^5; 2 of 40 seeded runs) moves its row by a 127th of the row's
    largest value, and every later position a little: up to 6.6e-5 on the mean of a run's
    logits, 3.9e-4 on one, where a float32 cache differs by 7.7e-4 or more on the mean."""
    mean, most, _ = BOUNDS[dtype]
    diff = (got - want).abs()
    assert diff.mean() <= mean and diff.max() <= most, (diff.mean(), diff.max())


class EagerOnCache(EagerModel):
    """The eager model (float32, or `model_dtype`) on a KV cache of another dtype."""

    def __init__(
        self,
        checkpoint: Path,
        cache_len: int,
        dtype: torch.dtype,
        model_dtype: torch.dtype = torch.float32,
    ):
        self.dtype = dtype
        super().__init__(checkpoint, cache_len, model_dtype)

    def reset(self) -> None:
        self.caches = new_kv_cache(self.config, self.cache_len, self.dtype)


@pytest.fixture(scope="module")
def kv_build(request, project) -> Callable[[str, Path], BuildReport]:
    """Build one of PACKAGES on a checkpoint; the builds take what the background compiled."""
    stop_warming(request, "kv_dtype")

    def build_package(name: str, checkpoint: Path) -> BuildReport:
        data = {"checkpoint": str(checkpoint), **PACKAGES[name][1]}
        return build(parse_recipe(data, name, Path(".")), project)

    return build_package


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def report(request, tiny_checkpoint, kv_build):
    """The tiny batch recipe (4 slots, a 1-layer draft on the target's cache) with the KV cache
    in the param's dtype."""
    return kv_build(f"tiny-kv-{request.param}", tiny_checkpoint)


@pytest.fixture(scope="module")
def engine(report) -> Engine:
    return Engine.load(report.path)


def cache_dtype(engine: Engine) -> torch.dtype:
    return getattr(torch, engine.manifest["models"]["target"]["kv_cache"]["dtype"])


def test_cache_takes_the_dtypes_bytes(engine, report, tiny_package):
    dtype = cache_dtype(engine)
    assert all(c.dtype == dtype for c in engine.target.caches)
    slots = engine.target.caches[0].shape[0]  # the batched graphs' rows; tiny_package has 1
    for c, f in zip(engine.target.caches, Engine.load(tiny_package).target.caches, strict=True):
        d = f.shape[-1]  # float32 rows of d values: 4 d bytes
        assert c.nbytes * 4 * d == f.nbytes * slots * row_width(d, dtype) * dtype.itemsize
    # The build measured what the narrower cache costs against the float32 one.
    assert any(f"{dtype} KV cache".removeprefix("torch.") in note for note in report.notes)
    assert set(report.perplexity) == {"reference", "package"}


def test_graphs_equal_eager_on_the_cache(engine, tiny_checkpoint):
    """prefill, then a verify-width block (every row's logits), then decode steps."""
    target = engine.target
    reset_caches(target)
    eager = EagerOnCache(tiny_checkpoint, target.cache_len, cache_dtype(engine))
    exact = EagerModel(tiny_checkpoint, target.cache_len)  # float32 cache: the control
    prompt = _prompts(1, eager.config.vocab_size, seed=5)[0] + list(range(7, 30))
    block = list(range(40, 40 + target.verify_len))
    got = [target.forward(prompt, 0), target.forward(block, len(prompt), all_logits=True)]
    pos = len(prompt) + len(block)
    got += [target.decode(t, pos + i) for i, t in enumerate((3, 9, 27))]
    for ref in (eager, exact):
        ref.reset()
    want, control = (
        [m.forward(prompt, 0)[-1], m.forward(block, len(prompt))] for m in (eager, exact)
    )
    for i, t in enumerate((3, 9, 27)):
        want.append(eager.forward([t], pos + i)[-1])
        control.append(exact.forward([t], pos + i)[-1])
    for g, w in zip(got, want, strict=True):
        assert_close_on_narrow_cache(g, w, cache_dtype(engine))
    # The bound sees the cache's rounding: a float32 cache gives other logits throughout.
    control_mean = BOUNDS[cache_dtype(engine)][2]
    assert min((g - c).abs().mean() for g, c in zip(got, control, strict=True)) > control_mean


@pytest.fixture(scope="module")
def batch_engine(report) -> BatchEngine:
    return BatchEngine.load(report.path)


@pytest.mark.parametrize("graph,t", [("batch_decode", 1), ("batch_verify", 5)])
def test_batched_graphs_equal_eager_on_the_cache(engine, batch_engine, tiny_checkpoint, graph, t):
    dtype = cache_dtype(engine)
    got, want = batched_and_eager(batch_engine.target, tiny_checkpoint, graph, t, dtype)
    assert_close_on_narrow_cache(got, want, dtype)


def test_greedy_and_speculative_equal_eager(engine, tiny_checkpoint):
    reset_caches(engine.target)
    eager = EagerOnCache(tiny_checkpoint, engine.target.cache_len, cache_dtype(engine))
    prompt = _prompts(1, eager.config.vocab_size, seed=8)[0]
    want = eager.greedy(prompt, 32)
    for mode in (None, "ngram", "draft"):
        config = GenerationConfig(max_new_tokens=32, ignore_eos=True, speculative=mode)
        assert engine.generate(prompt, config).token_ids == want, mode


def test_batch_equals_each_request_alone(engine, batch_engine):
    config = GenerationConfig(
        max_new_tokens=16, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=3)
    )
    prompts = _prompts(6, engine.target.vocab_size, seed=4)
    want = [engine.generate(p, config).token_ids for p in prompts]
    got = batch_engine.generate_many(prompts, config)
    assert [r.token_ids for r in got] == want


def test_cpp_runtime_equals_python(run_bin, engine, report):
    prompt = _prompts(1, engine.target.vocab_size, seed=9)[0]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = engine.generate(prompt, config).token_ids
    args = ("--max-new-tokens", "24", "--ignore-eos")
    assert cpp_generate(run_bin, report.path, prompt, *args)["ids"] == want
    draft = cpp_generate(run_bin, report.path, prompt, *args, "--speculative")
    assert draft["ids"] == want


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_windows_and_softcaps_on_a_narrow_cache(tmp_path_factory, kv_build, kv):
    """Gemma 2's shape: sliding-window layers (window 8: the kernel reads the cache from the
    window's first key) and softcapped scores (an int8 key's scale applied before the cap; the
    prefill through the kernel too, whose matmuls on a decoded span do not compile). Greedy,
    plain and with n-gram lookup, equals the eager model's on such a cache."""
    pytest.importorskip("transformers")
    checkpoint = make_family_checkpoint(tmp_path_factory.mktemp("gemma2") / "g", "gemma2")
    engine = Engine.load(kv_build(f"gemma2-{kv}-kv", checkpoint).path)
    eager = EagerOnCache(checkpoint, engine.target.cache_len, getattr(torch, kv))
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(5, eager.config.vocab_size, (12,), generator=gen).tolist() * 2
        want = eager.greedy(prompt, 24)
        for mode in (None, "ngram"):
            config = GenerationConfig(max_new_tokens=24, ignore_eos=True, speculative=mode)
            assert engine.generate(prompt, config).token_ids == want, (seed, mode)


def test_bfloat16_package_on_an_int8_cache(tied_checkpoint, kv_build, run_bin):
    """A bfloat16 package with `kv_cache_dtype: int8`: the kernel reads the int8 rows with q
    widened to float32. Each graph against the eager bfloat16 model on an int8 cache (both
    round activations to bfloat16, in other orders) and against the float32 model on a float32
    cache (bfloat16's bound, as for a bfloat16 cache); the C++ runtime generates Python's ids."""
    report = kv_build("tiny-bf16-kv8", tied_checkpoint)
    assert any("int8 KV cache" in note for note in report.notes)
    engine = Engine.load(report.path)
    target = engine.target
    d = target.config["head_dim"]
    assert all(
        c.dtype == torch.int8 and c.shape[-1] == row_width(d, torch.int8) for c in target.caches
    )
    eager = EagerOnCache(tied_checkpoint, target.cache_len, torch.int8, torch.bfloat16)
    exact = EagerModel(tied_checkpoint, target.cache_len)
    prompt = _prompts(1, eager.config.vocab_size, seed=6)[0]
    block = list(range(40, 40 + target.verify_len))
    reset_caches(target)
    got = [target.forward(prompt, 0), target.forward(block, len(prompt), all_logits=True)]
    got.append(target.decode(3, len(prompt) + len(block)))
    for ref in (eager, exact):
        ref.reset()
        want = [ref.forward(prompt, 0)[-1], ref.forward(block, len(prompt))]
        want.append(ref.forward([3], len(prompt) + len(block))[-1])
        for g, w in zip(got, want, strict=True):
            w = w.float()
            assert ((g - w).norm() / w.norm()).item() < 2e-2  # bfloat16's: measured 4-5e-3
    prompt = _prompts(1, eager.config.vocab_size, seed=9)[0]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = engine.generate(prompt, config).token_ids
    args = ("--max-new-tokens", "24", "--ignore-eos")
    assert cpp_generate(run_bin, report.path, prompt, *args)["ids"] == want


def test_narrow_cache_needs_the_kernels_head_dim(tiny_checkpoint):
    recipe = parse_recipe({"checkpoint": str(tiny_checkpoint), "kv_cache_dtype": "int8"}, "r", ".")
    cfg = replace(ModelConfig.from_hf(open_checkpoint(tiny_checkpoint).config), head_dim=24)
    with pytest.raises(RecipeError, match="multiple of 16, and LlamaForCausalLM's is 24"):
        recipe_kv_cache(cfg, recipe)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {"kv_cache_dtype": "float16"},
            r"kv_cache_dtype 'float16'; valid: float32, bfloat16, int8",
        ),
        ({"kv_cache_dtype": 16}, r"kv_cache_dtype must be a string"),
        ({**BF16, "formats": ["aoti", "onnx"]}, r"formats onnx is for float32 .*KV cache"),
        ({**BF16, "device": "cuda"}, r"kv_cache_dtype other than dtype is for CPU packages"),
        (
            {"kv_cache_dtype": "float32", "dtype": "bfloat16"},
            r"kv_cache_dtype float32 is wider than dtype bfloat16: .*; drop kv_cache_dtype or "
            "choose int8",
        ),
    ],
)
def test_bad_kv_cache_dtype_is_a_recipe_error(tiny_checkpoint, extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"checkpoint": str(tiny_checkpoint), **extra}, "r", Path("."))
