"""`quantize: {gguf: keep}` on tiny GGUFs written as llama.cpp writes them: every block type,
rows moved by the fuse pass (Gemma's q/k/v of mixed types stacked) and by the import (GPT-NeoX's
qkv regrouped), inputs moved by the import (Qwen3.5's value heads), a tied embedding read from
its head's blocks. The compiled graphs must give the eager model of the imported (dequantized)
checkpoint's logits, and generate its tokens (float activations), or come near them (integer
numerics, on GPT-NeoX).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE, stop_warming
from reference import EagerModel, reset_caches
from test_gguf_families import _checkpoint, _write_gguf

from aotgen.checkpoint.gguf import KEPT_TYPES, import_gguf
from aotgen.checkpoint.hf import CheckpointError
from aotgen.kernels import gguf_blocks as gb
from aotgen.package.build import build
from aotgen.recipe import RecipeError, parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.tokenizer import Tokenizer

pytest.importorskip("transformers")

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FAMILIES = {  # arch -> (checkpoint sizes, block types cycled over its matrices)
    # k-quants need 256 inputs; o_proj (4 heads x 32) has 128, so it takes a legacy type
    "gemma3": (dict(hidden_size=256, intermediate_size=512), ("Q4_K", "Q6_K", "Q5_K", *LEGACY)),
    "gptneox": ({}, LEGACY),
    # experts of 256 inputs both ways; gate and up of a block one type, down another
    "qwen3moe": (dict(hidden_size=256, moe_intermediate_size=256), ("Q4_K", "Q6_K", *LEGACY)),
}


def test_kept_types_are_the_kernels():
    assert set(KEPT_TYPES) == set(gb.QTYPES)


# package -> (arch, recipe keys) of the compiled packages (tests/real_builds.py compiles them
# ahead)
PACKAGES = {
    "keep-gemma3": ("gemma3", {"quantize": {"gguf": "keep"}}),  # every block type, float
    "keep-gptneox-int8": ("gptneox", {"quantize": {"gguf": "keep", "activations": "int8"}}),
    "keep-tp2": ("qwen2", {"quantize": {"gguf": "keep"}, "parallel": {"tensor": 2}}),
    # 2 key heads, 4 value heads: the import moves out_proj's inputs
    "keep-qwen35": ("qwen35", {"quantize": {"gguf": "keep"}}),
    "keep-qwen3moe": ("qwen3moe", {"quantize": {"gguf": "keep"}}),  # experts on their blocks
}


def package_recipe(tmp: Path, name: str) -> dict:
    """A package's recipe on a tiny GGUF of its arch (FAMILIES' block types, else the legacy
    ones), written and imported into tmp."""
    arch, keys = PACKAGES[name]
    sizes, qtypes = FAMILIES.get(arch, ({}, LEGACY))
    _write_gguf(_checkpoint(tmp / "hf", arch, **sizes), tmp / "m.gguf", arch, qtypes=qtypes)
    imported = import_gguf(tmp / "m.gguf", tmp / "imported")
    return {"checkpoint": str(imported), **TINY_RECIPE, **keys}


def _kept_build(request, name: str):
    stop_warming(request, "gguf_keep")  # the builds take what the background compiled
    tmp = request.getfixturevalue("tmp_path_factory").mktemp(name)
    raw = package_recipe(tmp, name)
    report = build(parse_recipe(raw, name, Path(".")), request.getfixturevalue("project"))
    engine = Engine.load(report.path)
    imported = Path(raw["checkpoint"])
    qtypes = FAMILIES.get(PACKAGES[name][0], ({}, LEGACY))[1]
    return report, engine, EagerModel(imported, engine.target.cache_len), qtypes


@pytest.fixture(scope="module")
def kept(request):
    """Gemma 3 with every block type, float activations."""
    return _kept_build(request, "keep-gemma3")


def _graph_error(engine: Engine, eager: EagerModel, graph: str, length: int, start: int) -> float:
    """One compiled graph's logits against the eager model's, from the same cache state
    (filled through prefill up to `start`): the relative error."""
    runner = engine.target
    g = torch.Generator().manual_seed(length + start)
    history = torch.randint(0, runner.vocab_size, (start + length,), generator=g).tolist()
    reset_caches(runner)
    for c in eager.caches:
        c.zero_()
    if start:
        runner.forward(history[:start], 0)
        eager.forward(history[:start], 0)
    tokens, pos = torch.tensor([history[start:]]), torch.arange(start, start + length)
    got = runner.graphs[graph](tokens, pos, runner.caches)[0]
    want = eager.forward(history[start:], start)
    if graph == "prefill":  # its last row only
        want = want[-1:]
    assert got.shape == want.shape
    return ((got - want).norm() / want.norm()).item()


def test_weights_run_on_their_blocks(kept):
    report, _, _, qtypes = kept
    manifest = json.loads((report.path / "manifest.json").read_text())
    entry = manifest["models"]["target"]["quantization"]
    assert entry["gguf"] == "keep" and entry["activations"] == "float32"
    used = {t for types in entry["weights"].values() for t in types.split("+")}
    assert used == set(qtypes)  # every type the file has runs on its blocks
    assert any("+" in types for types in entry["weights"].values())  # mixed fused q/k/v
    assert any("gguf keep:" in note for note in report.notes)
    # the tied embedding too: its rows read from the head's blocks, whatever their type
    assert not any("float:" in note for note in report.notes), report.notes
    ppl = entry["perplexity"]  # the same model: the eager checkpoint's perplexity
    assert ppl["package"] == pytest.approx(ppl["reference"], rel=1e-4)


GRAPHS = [("prefill", 11, 0), ("prefill", 16, 5), ("decode", 1, 7), ("verify", 5, 9)]


@pytest.mark.parametrize("graph,length,start", GRAPHS)
def test_graph_logits_equal_the_dequantized_checkpoint(kept, graph, length, start):
    """Float32 rounding only: on AVX2 the kernel sums codes x inputs per group and applies
    scale and offset after (kernels/gguf_blocks.cpp), which measured 2e-7 to 1.5e-5 from the
    eager float32 logits depending on the position and on the tiles the build's autotune
    picked (eager float32 itself: 2e-7 to 1.1e-6 from float64). The kernel's own precision
    is held to 1e-6 of its output in test_gguf_blocks."""
    _, engine, eager, _ = kept
    assert _graph_error(engine, eager, graph, length, start) < 5e-5


def test_greedy_equals_eager(kept):
    _, engine, eager, _ = kept
    ids = engine.tokenizer.encode("Paris is the capital of")
    result = engine.generate(ids, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert result.token_ids == eager.greedy(ids, 24)


@pytest.fixture(scope="module")
def kept_qwen35(request):
    """Qwen3.5 with the legacy block types: its value heads regrouped at import."""
    return _kept_build(request, "keep-qwen35")


def test_inputs_moved_at_import_run_on_their_blocks(kept_qwen35):
    """Every linear of the model runs on the file's blocks, out_proj too, whose inputs the
    import put back in HF's order: its activations are gathered in the file's order, so the
    graphs give the dequantized checkpoint's logits and its greedy tokens."""
    report, engine, eager, _ = kept_qwen35
    manifest = json.loads((report.path / "manifest.json").read_text())
    kept = manifest["models"]["target"]["quantization"]["weights"]
    out_projs = [name for name in kept if name.endswith("linear_attn.out_proj.weight")]
    # fused: each linear-attention layer's 4 in-projections, out_proj, gate/up, down; the
    # attention layer's q/k/v, o, gate/up, down; the head
    assert len(out_projs) == 3 and len(kept) == 3 * 4 + 4 + 1
    for graph, length, start in GRAPHS:
        assert _graph_error(engine, eager, graph, length, start) < 5e-5, graph
    ids = engine.tokenizer.encode("Paris is the capital of")
    result = engine.generate(ids, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert result.token_ids == eager.greedy(ids, 24)


@pytest.fixture(scope="module")
def kept_moe(request):
    """Qwen3-MoE, its experts stacked in the file as llama.cpp writes them."""
    return _kept_build(request, "keep-qwen3moe")


def test_experts_run_on_their_blocks(kept_moe):
    """Every layer's experts run on the file's blocks (gate/up and down of different types,
    k-quants and legacy), beside the linears; prefill (many rows an expert), decode and verify
    give the dequantized checkpoint's logits, and greedy generation its tokens."""
    report, engine, eager, _ = kept_moe
    manifest = json.loads((report.path / "manifest.json").read_text())
    kept = manifest["models"]["target"]["quantization"]["weights"]
    experts = {name: t for name, t in kept.items() if ".experts." in name}
    layers = eager.config.num_hidden_layers
    assert len(experts) == 2 * layers and len(set(experts.values())) >= 4, experts
    assert any(name.endswith("o_proj.weight") for name in kept)
    assert not any("experts" in note for note in report.notes if "float:" in note)
    for graph, length, start in GRAPHS:
        assert _graph_error(engine, eager, graph, length, start) < 5e-5, graph
    ids = engine.tokenizer.encode("Paris is the capital of")
    result = engine.generate(ids, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    assert result.token_ids == eager.greedy(ids, 24)


@pytest.fixture(scope="module")
def integer(request):
    """GPT-NeoX with the legacy block types, in integer numerics (`activations: int8`)."""
    return _kept_build(request, "keep-gptneox-int8")


@pytest.mark.parametrize("graph,length,start", GRAPHS)
def test_integer_numerics_graphs(integer, graph, length, start):
    """The compiled integer-dot graphs near the dequantized checkpoint's logits (activations
    rounded to int8 per block: about 1 % of their scale; the kernel itself is held to
    `gguf_dot.reference_dot` in tests/test_gguf_dot.py)."""
    report, engine, eager, _ = integer
    manifest = json.loads((report.path / "manifest.json").read_text())
    assert manifest["models"]["target"]["quantization"]["activations"] == "int8"
    assert _graph_error(engine, eager, graph, length, start) < 5e-2


@pytest.mark.parametrize(
    "quantize,match",
    [
        ({"gguf": "drop"}, "quantize.gguf: 'drop'; valid: keep"),
        ({"gguf": "keep", "linear": "int8"}, "linear cannot be combined with `gguf: keep`"),
        ({"gguf": "keep", "activations": "bfloat16"}, "valid: float32, int8"),
    ],
)
def test_bad_options_are_one_line(tiny_checkpoint, project, quantize, match):
    raw = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, "quantize": quantize}
    with pytest.raises(RecipeError, match=match):
        build(parse_recipe(raw, "bad-keep", Path(".")), project)


def test_keep_needs_a_gguf_checkpoint(tiny_checkpoint, project):
    raw = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, "quantize": {"gguf": "keep"}}
    with pytest.raises(CheckpointError, match="holds no GGUF blocks"):
        build(parse_recipe(raw, "keep-hf", Path(".")), project)
    assert not (project.artifacts_dir / "keep-hf").exists()


def test_keep_refuses_bfloat16(tiny_checkpoint, project):
    raw = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, "dtype": "bfloat16"}
    raw["quantize"] = {"gguf": "keep"}
    with pytest.raises(RecipeError, match="dtype bfloat16: the blocks dequantize to float32"):
        build(parse_recipe(raw, "keep-bf16", Path(".")), project)


class _EagerRunner:
    """The eager model as tp_worker's scenarios drive a runner."""

    def __init__(self, eager: EagerModel):
        self.eager, self.vocab_size = eager, eager.config.vocab_size

    def forward(self, tokens: list[int], start_pos: int, all_logits: bool = True) -> torch.Tensor:
        return self.eager.forward(tokens, start_pos)


def test_tensor_parallel_shards_keep_their_blocks(request, project, tmp_path):
    """TP=2 of a kept Qwen2 checkpoint: the column-wise shards (whole rows) and the row-wise
    ones (each row's half, cut between blocks) still run on the file's blocks, and the ranks
    together give the dequantized checkpoint's logits and greedy tokens."""
    from test_tp import _tp_outputs
    from tp_worker import GREEDY_PROMPT, GREEDY_TOKENS, SCENARIOS, scenario_logits

    stop_warming(request, "gguf_keep")
    raw = package_recipe(tmp_path / "keep-tp", "keep-tp2")
    imported = Path(raw["checkpoint"])
    tp2 = build(parse_recipe(raw, "keep-tp2", Path(".")), project)
    entry = json.loads((tp2.path / "manifest.json").read_text())["models"]["target"]
    kept = entry["quantization"]["weights"]
    assert any("o_proj" in name for name in kept)  # row-wise shards
    assert any("down_proj" in name for name in kept)
    assert any("gate_proj" in name for name in kept)  # column-wise
    eager = EagerModel(imported, entry["kv_cache"]["cache_len"])
    got = _tp_outputs(tp2.path, tmp_path / "tp2.pt")
    for name, t, s in SCENARIOS:
        ref = scenario_logits(_EagerRunner(eager), t, s)
        out = got["logits"][f"{name}-{t}-{s}"]
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, f"{name} T={t} at {s}"
    ids = Tokenizer.from_dir(imported).encode(GREEDY_PROMPT)
    assert got["greedy"] == eager.greedy(ids, GREEDY_TOKENS)
