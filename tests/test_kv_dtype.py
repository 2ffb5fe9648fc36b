"""`kv_cache_dtype: bfloat16` on a float32 package: the graphs write keys and values rounded to
bfloat16 and attend over them in float32 (kernels/attention.cpp widens them exactly), so every
graph equals the eager model run on a bfloat16 cache (float32's bound, but for a key that
rounds to the neighbouring bfloat16); both runtimes allocate the cache at half the bytes and
generate what the eager model does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from reference import EagerModel, reset_caches

from aotgen.model.llama import new_kv_cache
from aotgen.package.build import build
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.batch_engine import BatchEngine
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.sampling import SamplingParams
from tests.test_batch import _prompts, batched_and_eager
from tests.test_cpp_runtime import cpp_generate

BF16 = {"kv_cache_dtype": "bfloat16"}


def assert_close_on_bf16_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits on a bfloat16 cache against the eager model's. A key or value the graph computes
    in another float32 order (fused, packed linears) can round to the neighbouring bfloat16:
    about one element in 10^4, moving the few logits that read it by up to ~2e-4 on the tiny
    model. So the bound is float32's on the mean, and a bfloat16 step's on the maximum."""
    diff = (got - want).abs()
    assert diff.mean() <= 1e-5 and diff.max() <= 1e-3, (diff.mean(), diff.max())


class EagerBf16(EagerModel):
    """The eager float32 model on a bfloat16 KV cache."""

    def reset(self) -> None:
        self.caches = new_kv_cache(self.config, self.cache_len, torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_report(tiny_checkpoint, project):
    """The tiny batch recipe (4 slots, a 1-layer draft on the target's cache), bfloat16 KV."""
    data = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, "max_batch": 4, **BF16}
    data["speculative"] = {"draft": {"layers": 1}}
    return build(parse_recipe(data, "tiny-kv-bf16", Path(".")), project)


@pytest.fixture(scope="module")
def engine(bf16_report) -> Engine:
    return Engine.load(bf16_report.path)


def test_cache_is_bfloat16_at_half_the_bytes(engine, bf16_report, tiny_package):
    kv = engine.manifest["models"]["target"]["kv_cache"]
    assert kv["dtype"] == "bfloat16"
    assert all(c.dtype == torch.bfloat16 for c in engine.target.caches)
    float_bytes = sum(c.nbytes for c in Engine.load(tiny_package).target.caches)
    slots = engine.target.caches[0].shape[0]  # the batched graphs' rows; tiny_package has 1
    assert sum(c.nbytes for c in engine.target.caches) * 2 == float_bytes * slots
    # The build measured what the narrower cache costs against the float32 one.
    assert any("bfloat16 KV cache" in note for note in bf16_report.notes)
    assert set(bf16_report.perplexity) == {"reference", "package"}


def test_graphs_equal_eager_on_a_bfloat16_cache(engine, tiny_checkpoint):
    """prefill, then a verify-width block (every row's logits), then decode steps."""
    target = engine.target
    reset_caches(target)
    eager = EagerBf16(tiny_checkpoint, target.cache_len)
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
        assert_close_on_bf16_cache(g, w)
    # The bound sees the cache's rounding: a float32 cache gives other logits throughout.
    assert min((g - c).abs().mean() for g, c in zip(got, control, strict=True)) > 1e-4


@pytest.fixture(scope="module")
def batch_engine(bf16_report) -> BatchEngine:
    return BatchEngine.load(bf16_report.path)


@pytest.mark.parametrize("graph,t", [("batch_decode", 1), ("batch_verify", 5)])
def test_batched_graphs_equal_eager_on_a_bfloat16_cache(batch_engine, tiny_checkpoint, graph, t):
    got, want = batched_and_eager(batch_engine.target, tiny_checkpoint, graph, t, torch.bfloat16)
    assert_close_on_bf16_cache(got, want)


def test_greedy_and_speculative_equal_eager(engine, tiny_checkpoint):
    reset_caches(engine.target)
    eager = EagerBf16(tiny_checkpoint, engine.target.cache_len)
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


def test_cpp_runtime_equals_python(run_bin, engine, bf16_report):
    prompt = _prompts(1, engine.target.vocab_size, seed=9)[0]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = engine.generate(prompt, config).token_ids
    args = ("--max-new-tokens", "24", "--ignore-eos")
    assert cpp_generate(run_bin, bf16_report.path, prompt, *args)["ids"] == want
    draft = cpp_generate(run_bin, bf16_report.path, prompt, *args, "--speculative")
    assert draft["ids"] == want


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"kv_cache_dtype": "int8"}, r"kv_cache_dtype 'int8'; valid: float32, bfloat16"),
        ({"kv_cache_dtype": 16}, r"kv_cache_dtype must be a string"),
        ({**BF16, "formats": ["aoti", "onnx"]}, r"formats onnx is for float32 .*KV cache"),
        ({**BF16, "device": "cuda"}, r"kv_cache_dtype other than dtype is for CPU packages"),
        (
            {"kv_cache_dtype": "float32", "dtype": "bfloat16"},
            r"the cache of a bfloat16 package is bfloat16; drop kv_cache_dtype",
        ),
    ],
)
def test_bad_kv_cache_dtype_is_a_recipe_error(tiny_checkpoint, extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"checkpoint": str(tiny_checkpoint), **extra}, "r", Path("."))
