"""Few-row attention over a KV cache prefix (kernels/attention.{py,cpp}): the kernel on every
ISA path the CPU can run equals SDPA in float64 on the same prefix and mask (with a softcap or
gpt-oss's sinks, the eager reference's matmuls), the CPU graphs of a package call it for
decode, verify, tree and batched steps (their logits against eager are checked by
test_package, test_tree and test_batch), and an AOTInductor graph passes it sinks.

Bound: float32 scores and sums in another order than SDPA's, and a polynomial e^x (relative
error ~2e-7): below 1e-5 absolute on outputs of unit scale (measured ~2e-6).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_RECIPE

from aotgen.export.aoti import export_graph, graph_specs
from aotgen.kernels import attention as at
from aotgen.kernels.cache_rows import decode_rows, encode_rows
from aotgen.model.llama import new_kv_cache
from tests.test_gguf_blocks import ISAS
from tests.test_packed import isa_library


def exact(cache: torch.Tensor) -> torch.Tensor:
    """The values a cache's rows hold, in float64: the reference reads the same ones."""
    return decode_rows(cache, torch.float64)


@pytest.fixture(scope="module", params=list(ISAS))
def lib(request):
    return isa_library(*ISAS[request.param], at.library)


# (KV heads, query heads per KV head, tokens T, keys N, cache length L, head_dim D)
SHAPES = (
    (3, 3, 1, 205, 260, 64),  # SmolLM2 decode
    (3, 3, 5, 205, 260, 64),  # verify
    (3, 3, 7, 1005, 1030, 64),
    (1, 4, 5, 37, 64, 256),  # Gemma 3: one KV head, head_dim 256
    (2, 2, 3, 17, 40, 32),  # N not a multiple of the vector width
    (4, 1, 32, 3, 8, 80),  # a 32-node tree over 3 keys; D = 5 vectors of 16
    (3, 3, 1, 2000, 2056, 64),  # decode over a long prefix: spans of keys, merged
    (1, 4, 1, 1100, 1200, 256),  # Gemma 3 decode: four spans (one head), the last shorter
    (3, 3, 5, 3000, 3010, 64),  # verify over a long prefix: several tiles read each span
)


@pytest.mark.parametrize("cache_dtype", at.CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_sdpa(lib, shape, cache_dtype):
    """bfloat16 caches are widened exactly, int8 rows' codes scaled, so the reference is
    float64 SDPA on the values the cache holds: the bound is float32's either way."""
    h, g, t, n, length, d = shape
    gen = torch.Generator().manual_seed(n + d)
    q = torch.randn(1, h, g * t, d, generator=gen) * d**-0.5
    k32, v32 = (torch.randn(1, h, length, d, generator=gen) for _ in range(2))
    k32[:, :, n:] = v32[:, :, n:] = float("nan")  # past the prefix: never read
    k, v = encode_rows(k32, cache_dtype), encode_rows(v32, cache_dtype)
    mask = torch.rand(t, n, generator=gen) < 0.7
    mask[:, 0] = True  # every row sees a key (SDPA gives NaN for a row that sees none)
    out = at.run_library(lib, q, k, v, mask)
    expect = at.attend_cache(q.double(), exact(k), exact(v), mask).float()
    assert (out - expect).abs().max() <= 1e-5
    if cache_dtype != torch.float32:  # the bound sees the cache's rounding
        assert (out - at.attend_cache(q, k32, v32, mask)).abs().max() > 1e-4


@pytest.mark.parametrize("cap", [5.0, 50.0])
def test_softcapped_scores_equal_the_reference(lib, cap):
    """Gemma 2's cap * tanh(scores / cap) before the softmax (cap 5 bends most scores of this
    scale, cap 50 few), one sequence and a batch; without the cap the result is another."""
    gen = torch.Generator().manual_seed(7)
    h, g, t, n, length, d = 2, 2, 5, 45, 64, 256
    q = torch.randn(2, h, g * t, d, generator=gen) * 0.3
    k, v = (torch.randn(3, h, length, d, generator=gen) for _ in range(2))
    mask = torch.rand(2, t, n, generator=gen) < 0.7
    mask[..., 0] = True
    slots = torch.tensor([2, 0])
    out = at.run_library(lib, q, k, v, mask, slots, cap)
    expect = at.attend_cache_slots(q.double(), k.double(), v.double(), mask, slots, cap).float()
    assert (out - expect).abs().max() <= 1e-5
    one = at.run_library(lib, q[:1], k[:1], v[:1], mask[0], cap=cap)
    expect = at.attend_cache(q[:1].double(), k[:1].double(), v[:1].double(), mask[0], cap)
    assert (one - expect.float()).abs().max() <= 1e-5
    uncapped = at.attend_cache(q[:1].double(), k[:1].double(), v[:1].double(), mask[0])
    assert (one - uncapped.float()).abs().max() > 1e-3


@pytest.mark.parametrize("cache_dtype", at.CACHE_DTYPES, ids=str)
def test_spans_a_row_sees_nothing_of(lib, cache_dtype):
    """A long prefix is split into spans of keys whose parts are merged: rows that see only
    the last keys (a sliding window), or only the first, leave whole spans unseen; a row
    that sees nothing gets zeros."""
    gen = torch.Generator().manual_seed(11)
    h, g, t, n, d = 1, 4, 3, 1500, 256
    q = torch.randn(1, h, g * t, d, generator=gen) * d**-0.5
    k, v = (encode_rows(torch.randn(1, h, n, d, generator=gen), cache_dtype) for _ in range(2))
    mask = torch.zeros(t, n, dtype=torch.bool)
    mask[0, -100:] = True
    mask[1, :40] = True
    out = at.run_library(lib, q, k, v, mask)
    seen = mask.repeat(g, 1).any(-1)
    expect = at.attend_cache(q.double(), exact(k), exact(v), mask).float()
    assert (out[:, :, seen] - expect[:, :, seen]).abs().max() <= 1e-5
    assert (out[:, :, ~seen] == 0).all()


# (KV heads, query heads per KV head, tokens T, keys N, cache length L, head_dim D) with
# sinks: several query heads per KV head, most with T > 1, so that row r's query head
# h * group + r // T is neither its KV head h nor h * group + r % T; the last two split the
# keys into spans merged after.
SINK_SHAPES = (
    (2, 3, 5, 45, 64, 64),
    (3, 2, 4, 17, 40, 32),
    (1, 4, 3, 37, 64, 256),  # one KV head
    (2, 4, 1, 2000, 2056, 64),  # decode: T = 1, the rows are the query heads
    (1, 4, 3, 1100, 1200, 256),
)


def sink_logits(heads: int, keys: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct sink logits around log(keys), where a sink weighs about as much as the keys
    (scores of unit scale): some above a row's scores' max (the sink sets the softmax's max),
    some below."""
    return math.log(keys) + torch.linspace(-4, 4, heads)[torch.randperm(heads, generator=gen)]


@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("cache_dtype", at.CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SINK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sinks_equal_the_reference(lib, shape, cache_dtype, cap):
    """gpt-oss's sinks: one more key per softmax, of score sinks[query head] and value zero;
    a row that sees no key gets zeros (all its weight on the sink)."""
    h, g, t, n, length, d = shape
    gen = torch.Generator().manual_seed(n + d + t)
    q = torch.randn(1, h, g * t, d, generator=gen) * d**-0.5
    k32, v32 = (torch.randn(1, h, length, d, generator=gen) for _ in range(2))
    k32[:, :, n:] = v32[:, :, n:] = float("nan")  # past the prefix: never read
    k, v = encode_rows(k32, cache_dtype), encode_rows(v32, cache_dtype)
    mask = torch.rand(t, n, generator=gen) < 0.7
    mask[:, 0] = True
    if t > 1:
        mask[-1] = False  # only the sink
    sinks = sink_logits(h * g, n, gen)
    out = at.run_library(lib, q, k, v, mask, cap=cap, sinks=sinks)

    def reference(sinks: torch.Tensor | None) -> torch.Tensor:
        return at.attend_cache(q.double(), exact(k), exact(v), mask, cap, sinks).float()

    assert (out - reference(sinks)).abs().max() <= 1e-5
    if t > 1:
        assert not out[:, :, t - 1 :: t].any()
    # The negative controls: each query head of a KV head reading the KV head's sink; none.
    by_kv_head = sinks[torch.arange(h).repeat_interleave(g)]
    assert (out - reference(by_kv_head)).abs().max() > 1e-3
    assert (out - reference(None)).abs().nan_to_num().max() > 1e-3


def test_batch_reads_each_sequence_slot(lib):
    """Batched graphs: sequence b reads cache slot slots[b] under its own mask rows."""
    gen = torch.Generator().manual_seed(3)
    b, h, g, t, n, length, d = 3, 3, 3, 2, 50, 64, 64
    q = torch.randn(b, h, g * t, d, generator=gen) * d**-0.5
    k, v = (torch.randn(5, h, length, d, generator=gen) for _ in range(2))
    slots = torch.tensor([4, 0, 2])
    mask = torch.rand(b, t, n, generator=gen) < 0.6
    mask[..., 0] = True
    out = at.run_library(lib, q, k, v, mask, slots)
    expect = at.attend_cache_slots(q.double(), k.double(), v.double(), mask, slots).float()
    assert (out - expect).abs().max() <= 1e-5
    # The negative control: reading slots in batch order is another result.
    wrong = at.run_library(lib, q, k, v, mask, torch.tensor([0, 1, 2]))
    assert (wrong - expect).abs().max() > 1e-2


@pytest.mark.parametrize("n", [45, 700], ids=["one-span", "two-spans"])
@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("cache_dtype", at.CACHE_DTYPES, ids=str)
def test_batch_sinks_equal_the_reference(lib, cache_dtype, cap, n):
    """`attend_cache_slots` with sinks: every sequence's rows take their query head's sink."""
    gen = torch.Generator().manual_seed(n)
    b, h, g, t, length, d = 3, 2, 3, 4, 720, 64
    q = torch.randn(b, h, g * t, d, generator=gen) * d**-0.5
    k, v = (encode_rows(torch.randn(5, h, length, d, generator=gen), cache_dtype) for _ in "kv")
    slots = torch.tensor([4, 0, 2])
    mask = torch.rand(b, t, n, generator=gen) < 0.6
    mask[..., 0] = True
    mask[1, 2] = False  # only the sink
    sinks = sink_logits(h * g, n, gen)
    out = at.run_library(lib, q, k, v, mask, slots, cap, sinks)

    def reference(sinks: torch.Tensor) -> torch.Tensor:
        return at.attend_cache_slots(q.double(), exact(k), exact(v), mask, slots, cap, sinks)

    assert (out - reference(sinks).float()).abs().max() <= 1e-5
    assert not out[1, :, 2::t].any()
    by_kv_head = sinks[torch.arange(h).repeat_interleave(g)]
    assert (out - reference(by_kv_head).float()).abs().max() > 1e-3


def test_row_that_sees_nothing_is_zero(lib):
    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 9, 16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1] = False
    out = at.run_library(lib, q, k, v, mask)
    assert not out[0, 0, 1].any()
    expect = at.attend_cache(q.double(), k.double(), v.double(), mask[:1]).float()
    assert (out[0, 0, 0] - expect[0, 0, 0]).abs().max() <= 1e-5


def test_head_dim_outside_the_vectors_is_refused(lib):
    q, k = torch.randn(1, 1, 1, 6), torch.randn(1, 1, 4, 6)
    with pytest.raises(ValueError, match="head_dim 6"):
        at.run_library(lib, q, k, k, torch.ones(1, 4, dtype=torch.bool))
    assert not at.applies(torch.randn(1, 1, 1, 12), torch.randn(1, 1, 4, 12))


def test_gradients_keep_sdpa():
    """The ops have no backward: a forward that autograd records (draft distillation) keeps
    SDPA."""
    q, k = torch.randn(1, 1, 1, 16, requires_grad=True), torch.randn(1, 1, 4, 16)
    assert not at.applies(q, k)
    assert at.applies(q.detach(), k)


@pytest.mark.parametrize("cache_dtype", at.CACHE_DTYPES, ids=str)
def test_cpu_graphs_call_the_kernel(tiny_model, cache_dtype):
    """The exported decode, verify, tree and batched graphs attend through the ops, on a
    float32, bfloat16 or int8 cache; prefill (any number of rows) keeps SDPA."""
    model, cfg, cache_len = tiny_model
    caches = new_kv_cache(cfg, cache_len, cache_dtype)
    specs = graph_specs(TINY_RECIPE["prefill_chunk"], TINY_RECIPE["verify_k"], 4, max_batch=3)
    calls = {}
    for spec in specs:
        graph = export_graph(model, spec, caches).graph
        calls[spec.name] = [len(graph.find_nodes(op="call_function", target=op)) for op in at.OPS]
    n = cfg.num_hidden_layers
    assert calls == {
        "prefill": [0, 0],
        "decode": [n, 0],
        "verify": [n, 0],
        "tree": [n, 0],
        "batch_decode": [0, n],
        "batch_verify": [0, n],
    }


class SinkOps(torch.nn.Module):
    """Both ops with sinks (AOTInductor passes the shim a pointer to the handle) and
    `attend_cache` without (a null pointer)."""

    def forward(self, q, k, v, mask, sinks, qb, kb, vb, masks, slots):
        return (
            torch.ops.aotgen.attend_cache(q, k, v, mask, 0.0, sinks),
            torch.ops.aotgen.attend_cache(q, k, v, mask),
            torch.ops.aotgen.attend_cache_slots(qb, kb, vb, masks, slots, 5.0, sinks),
        )


def test_compiled_graph_passes_sinks_to_the_kernel(compile_exported):
    """An AOTInductor graph calling the ops through their C shims gives the eager result."""
    gen = torch.Generator().manual_seed(5)
    h, g, t, n, length, d = 2, 3, 4, 45, 64, 64
    q, qb = (torch.randn(b, h, g * t, d, generator=gen) * d**-0.5 for b in (1, 3))
    k, v = (torch.randn(1, h, length, d, generator=gen) for _ in "kv")
    kb, vb = (encode_rows(torch.randn(5, h, length, d, generator=gen), torch.int8) for _ in "kv")
    mask, masks = torch.rand(t, n, generator=gen) < 0.7, torch.rand(3, t, n, generator=gen) < 0.7
    mask[:, 0] = masks[..., 0] = True
    args = (q, k, v, mask, sink_logits(h * g, n, gen), qb, kb, vb, masks, torch.tensor([4, 0, 2]))
    ep = torch.export.export(SinkOps(), args)
    compiled = compile_exported(ep, args)
    eager = SinkOps()(*args)
    for out, expect in zip(compiled(*args), eager, strict=True):
        assert (out - expect).abs().max() <= 1e-5
    assert (eager[0] - eager[1]).abs().max() > 1e-3  # the sinks count
