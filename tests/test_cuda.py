"""`device: cuda` packages: the CUDA quantized kernels, CUDA-graph replay.

On a machine without a CUDA GPU (this project's CI) the refusals run (a CUDA build or a CUDA
package fails at once with the reason, before anything is written or loaded), and the
device-agnostic pieces of the GPU path: attention over the given cache positions against prefix
attention, the spans replayed graphs attend over, and
attention as matmuls against SDPA. The GPU tests run where `torch.cuda.is_available()`: build
tiny fp32 / int8 / int4 packages for the GPU, compare every compiled graph with the same graph
run eagerly on the GPU (tight) and with the fp32 model (loose; bounds as in test_quantize.py),
replayed CUDA graphs with direct calls of the same graphs, greedy decoding on the GPU with a
host loop, and the C++ runtime's ids with the Python runtime's on a CUDA package.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_RECIPE
from families import make_family_checkpoint
from reference import reset_caches
from tiny import make_tiny_checkpoint

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.export import aoti
from aotgen.export.aoti import export_graph, graph_specs
from aotgen.kernels import attention
from aotgen.model import layers
from aotgen.model.layers import attend_rows
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.package.build import build
from aotgen.package.manifest import PackageError, target_info
from aotgen.passes.gemv import int8_linears_for_gpu
from aotgen.passes.quantize import QuantizePass
from aotgen.passes.quantize_numerics import kernel_problem
from aotgen.passes.quantize_options import parse_quantize
from aotgen.recipe import Recipe, RecipeError, kv_cache_len, parse_recipe
from aotgen.runtime.cuda_graph import ReplayedGraph
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.model_runner import MIN_KEY_SPAN, key_span
from aotgen.runtime.tree import Tree

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a CPU-only machine")

INT8 = {"linear": "int8", "embedding": "int8"}
# in_features 128 and 256: CUDA tinygemm takes K in multiples of 128 (innerKTiles 8 x 16).
INT4 = {"linear": {"int4": {"groupsize": 32}}, "overrides": {"lm_head": "int8"}}


def _recipe(checkpoint: Path, name: str, **extra) -> Recipe:
    return parse_recipe(
        {"checkpoint": str(checkpoint), **TINY_RECIPE, "device": "cuda", **extra}, name, Path(".")
    )


def test_recipe_device_is_checked(tiny_checkpoint):
    with pytest.raises(RecipeError, match="device 'tpu'; valid: cpu, cuda"):
        _recipe(tiny_checkpoint, "x", device="tpu")
    with pytest.raises(RecipeError, match="`parallel` runs on CPU ranks only"):
        _recipe(tiny_checkpoint, "x", parallel={"tensor": 2})
    cpu = parse_recipe({"checkpoint": str(tiny_checkpoint)}, "x", Path("."))
    assert cpu.device == "cpu"
    assert target_info()["device"] == "cpu"


@needs_no_gpu
def test_cuda_build_without_a_gpu_fails_before_writing(tiny_checkpoint, project):
    with pytest.raises(RecipeError, match="device cuda, but this torch .* without CUDA"):
        build(_recipe(tiny_checkpoint, "tiny-cuda"), project)
    assert not (project.artifacts_dir / "tiny-cuda").exists()
    assert not list(project.artifacts_dir.glob(".tiny-cuda*"))


@pytest.fixture
def relabelled(tiny_package, tmp_path) -> Path:
    """The tiny CPU package relabelled as a CUDA one (the manifest itself is not hashed)."""
    pkg = tmp_path / "relabelled"
    shutil.copytree(tiny_package, pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["target"] |= {"device": "cuda", "gpu": "NVIDIA H100", "compute_capability": "9.0"}
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    return pkg


@needs_no_gpu
def test_cuda_package_is_refused_without_a_gpu(relabelled):
    """Refused before any native code is loaded."""
    with pytest.raises(PackageError, match=r"built for a CUDA GPU \(NVIDIA H100\) but this torch"):
        Engine.load(relabelled)


@pytest.mark.skipif(
    not torch.__version__.startswith("2.13"),
    reason="CPU packages need the pinned torch 2.13 (2.11's CPU attention lowering fails)",
)
def test_inspect_names_the_device(tiny_package, relabelled):
    from typer.testing import CliRunner

    from aotgen.cli import app

    isa = target_info()["isa"]
    for pkg, device in [
        (tiny_package, f"· cpu {isa}"),
        (relabelled, "· cuda (NVIDIA H100, sm 9.0)"),
    ]:
        result = CliRunner().invoke(app, ["inspect", str(pkg)])
        assert result.exit_code == 0, result.output
        assert device in result.output.replace("\n", " "), result.output


@pytest.mark.parametrize("family", ["llama", "gemma3", "gptneox-parallel"])
def test_key_pos_attention_equals_prefix_attention(family, tmp_path, monkeypatch):
    """CUDA builds export decode, verify and tree attending over the cache positions `key_pos`
    they are given, masked past their own positions (model/layers.py). Run eagerly, over any
    span that covers the positions (up to the whole cache), they must give the logits and
    cache entries of attention over the prefix (Gemma's sliding window too), and exported as
    a CUDA build exports them (the span dynamic) they must trace with no host read and run at
    another span. The GPU's attention code runs here (`attend_one`, `attend_rows`), not the
    CPU attention kernel."""
    monkeypatch.setattr(attention, "applies", lambda q, k_cache: False)
    monkeypatch.setattr(layers, "rows_as_matmuls", lambda q: True)
    ckpt = open_checkpoint(make_family_checkpoint(tmp_path / family, family))
    cfg = ModelConfig.from_hf(ckpt.config)
    model = load_model(cfg, ckpt.load_weights(), 64, torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=g)
    prefix = new_kv_cache(cfg, 64)
    with torch.no_grad():
        model(ids[:, :20], torch.arange(20), prefix)
        spans = {n: [c.clone() for c in prefix] for n in ("exact", 32, 64)}
        chain = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]).bool()
        steps = [  # decode; verify; a tree of 4 nodes (two branches) written at 26..29
            (ids[:, 20:21], torch.tensor([20]), None, 21),
            (ids[:, 21:26], torch.arange(21, 26), None, 26),
            (ids[:, 26:30], torch.tensor([26, 27, 27, 28]), chain, 30),
        ]
        for tokens, pos, tree_mask, end in steps:
            ref = model(tokens, pos, prefix, tree_mask)
            for n, caches in spans.items():
                key_pos = torch.arange(end if n == "exact" else n)
                got = model(tokens, pos, caches, tree_mask, None, key_pos)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for caches in spans.values():
        for got, ref in zip(caches, prefix, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    def host_reads(ep) -> list:
        return ep.graph.find_nodes(op="call_function", target=torch.ops.aten.item.default)

    # Exported as for a GPU (export/aoti.py): traced over the whole cache, the span dynamic.
    monkeypatch.setattr(aoti, "replayable", lambda spec, device: not spec.dynamic)
    spec = next(s for s in graph_specs(16, 4, tree_nodes=4) if s.name == "tree")
    ep = export_graph(model, spec, [c.clone() for c in spans[64]])
    assert not host_reads(ep)
    tokens, pos, tree_mask, _ = steps[2]
    with torch.no_grad():  # the tree step again, over 32 keys
        got = ep.module()(tokens, pos, spans[32], tree_mask, None, torch.arange(32))
        ref = model(tokens, pos, spans[64], tree_mask, None, torch.arange(64))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The negative control: attention over the prefix reads its length back.
    assert host_reads(torch.export.export(model, (*steps[1][:2], prefix), strict=False))


def test_key_span_covers_the_position_in_a_few_captures():
    """Replayed graphs attend over one of a few spans (runtime/model_runner.py): the shortest power
    of two from MIN_KEY_SPAN that covers the positions, the whole cache past the last."""
    spans = {key_span(attend, 2053) for attend in range(1, 2054)}
    assert spans == {128, 256, 512, 1024, 2048, 2053}
    for attend in range(1, 2054):
        span = key_span(attend, 2053)
        assert attend <= span and (span == MIN_KEY_SPAN or span == 2053 or span < 2 * attend)
    assert key_span(100, 64) == 64


@pytest.mark.parametrize("rows, batch", [(1, 1), (5, 1), (5, 2)])
def test_attention_as_matmuls_equals_sdpa(rows, batch):
    """`attend_rows` (fixed-width graphs on a GPU, model/layers.py) against SDPA, GQA-folded
    rows over a long, partly masked cache, for one sequence and a batch; keys past every row's
    position never count."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 3, 3 * rows, 64, generator=g)
    keys, values = (torch.randn(batch, 3, 300, 64, generator=g) for _ in range(2))
    mask = torch.arange(300) <= torch.arange(200, 200 + rows).repeat(3).unsqueeze(1)
    keys[..., 250:, :] = values[..., 250:, :] = 1e4  # past every row's position: masked
    ref = F.scaled_dot_product_attention(
        q, keys[..., :250, :], values[..., :250, :], attn_mask=mask[:, :250], scale=0.125
    )
    got = attend_rows(q, keys, values, mask, 0.125)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ---- on a GPU ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_checkpoints(tmp_path_factory) -> dict[int, Path]:
    """hidden 128: every in_features a multiple of tinygemm's 128; hidden 96 (intermediate
    192): int4 must zero-pad in_features to 128 / 256, as SmolLM2's 576 needs."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        hidden: make_tiny_checkpoint(
            root / f"tiny-gpu-{hidden}", hidden=hidden, intermediate=2 * hidden, seed=3
        )
        for hidden in (128, 96)
    }


@needs_gpu
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cuda_kernels_run(kind):
    assert kernel_problem(kind, "cuda", "bfloat16") is None


@needs_gpu
@pytest.mark.parametrize(
    "name, quantize, loose, hidden",
    [
        ("fp32", None, 1e-4, 128),
        ("int8", INT8, 0.05, 128),
        ("int4", INT4, 0.15, 128),
        ("int4-padded", INT4, 0.15, 96),
    ],
)
def test_cuda_package_matches_eager(name, quantize, loose, hidden, gpu_checkpoints, project):
    """Each compiled graph vs the same (quantized) graph run eagerly on the GPU, and vs the
    fp32 model; the quantize pass emits the CUDA weight-only kernels (int8's then become
    float32 reductions and matmuls, passes/gemv.py, in both)."""
    gpu_checkpoint = gpu_checkpoints[hidden]
    extra = {"quantize": quantize} if quantize else {}
    report = build(_recipe(gpu_checkpoint, f"tiny-cuda-{name}", **extra), project)
    manifest = json.loads((report.path / "manifest.json").read_text())
    assert manifest["target"]["device"] == "cuda" and manifest["target"]["compute_capability"]
    engine = Engine.load(report.path)
    runner = engine.target
    assert runner.device.type == "cuda" and runner.caches[0].is_cuda

    ckpt = open_checkpoint(gpu_checkpoint)
    cfg = ModelConfig.from_hf(ckpt.config)
    cache_len = kv_cache_len(TINY_RECIPE["max_seq_len"], TINY_RECIPE["verify_k"])
    model = load_model(cfg, ckpt.load_weights(), cache_len, torch.float32).to("cuda")
    qp = QuantizePass(parse_quantize(quantize), "cuda") if quantize else None
    caches = {k: new_kv_cache(cfg, cache_len, device="cuda") for k in ("eager", "fp32")}
    specs = graph_specs(TINY_RECIPE["prefill_chunk"], TINY_RECIPE["verify_k"])
    eager = {}
    for s in specs:
        ep = export_graph(model, s, caches["eager"])
        if qp:
            ep = qp(ep)
            ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
            assert f"aten._weight_{name[:4]}pack_mm.default" in ops
            ep = int8_linears_for_gpu(ep)  # as compile.py does: int8 in float32 on a GPU
        eager[s.name] = ep.module()
    g = torch.Generator().manual_seed(0)
    for graph, start, length in [("prefill", 0, 11), ("decode", 7, 1), ("verify", 9, 5)]:
        history = torch.randint(0, cfg.vocab_size, (start + length,), generator=g).cuda()
        reset_caches(runner)
        for c in (*caches["eager"], *caches["fp32"]):
            c.zero_()
        with torch.no_grad():
            if start:
                runner.forward(history[:start].tolist(), 0)
                prefix = (history[None, :start], torch.arange(start, device="cuda"))
                eager["prefill"](*prefix, caches["eager"])
                model(*prefix, caches["fp32"])
            tokens = history[None, start:]
            end = start + length
            pos = torch.arange(start, end, device="cuda")
            got = runner.graphs[graph](tokens, pos, runner.caches, attend=end).float()
            # decode and verify take the cache positions they attend (a span covering `end`)
            keys = torch.arange(key_span(end, cache_len), device="cuda")
            extra = () if graph == "prefill" else (None, None, keys)
            ref_q = eager[graph](tokens, pos, caches["eager"], *extra).float()
            ref = model(tokens, pos, caches["fp32"]).float()
        if graph == "prefill":  # its last row only
            ref = ref[:, -1:]
        # int4 runs in bf16 (8 significant bits): compiled and eager round after different
        # fusions, an ulp (0.4 %) apart here and there; a wrong kernel is off by O(1).
        tight = 1e-2 if name.startswith("int4") else 1e-3
        assert ((got - ref_q).norm() / ref_q.norm()).item() < tight, graph
        assert ((got - ref).norm() / ref.norm()).item() < loose, graph
    result = engine.generate([5, 6, 7], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8


def _replay_package(name: str, quantize, gpu_checkpoints, project) -> Path:
    """A tiny CUDA package with a tree graph, built once per session."""
    path = project.artifacts_dir / f"tiny-cuda-replay-{name}"
    if (path / "manifest.json").is_file():
        return path
    extra = {"quantize": quantize} if quantize else {}
    return build(_recipe(gpu_checkpoints[128], path.name, tree_nodes=4, **extra), project).path


@needs_gpu
@pytest.mark.parametrize("name, quantize", [("fp32", None), ("int8", INT8)])
def test_cuda_graph_replays_equal_direct_calls(name, quantize, gpu_checkpoints, project):
    """Decode, verify and tree replayed as CUDA graphs (runtime/cuda_graph.py) give the logits
    of the same graphs called directly, at positions other than the captured ones, and greedy
    generation (plain and speculative) the same ids."""
    path = _replay_package(name, quantize, gpu_checkpoints, project)
    signatures = json.loads((path / "manifest.json").read_text())["models"]["target"]["graphs"]
    assert {n for n, s in signatures.items() if s["attention"] == "key_pos"} == {
        "decode",
        "verify",
        "tree",
    }
    if quantize:  # int8 on a GPU: rewritten to float32 Inductor kernels, as the manifest says
        entry = json.loads((path / "manifest.json").read_text())["models"]["target"]
        assert entry["quantization"]["linear"]["activation_dtype"] == "float32"
    replayed, direct = Engine.load(path), Engine.load(path, cuda_graphs=False)
    r, d = replayed.target, direct.target
    assert all(isinstance(r.graphs[n], ReplayedGraph) for n in ("decode", "verify", "tree"))
    assert not any(isinstance(g, ReplayedGraph) for g in d.graphs.values())
    g = torch.Generator().manual_seed(1)
    history = torch.randint(0, r.vocab_size, (150,), generator=g).tolist()
    for runner in (r, d):
        runner.forward(history[:40], 0)
    tree = Tree([5, 6, 7, 8], [-1, 0, 0, 1], [None] * 4)
    # Captures at 40 (over 128 keys) and 120 (the tree's over the whole cache), replays after.
    for pos in (40, 47, 120, 130):
        torch.testing.assert_close(r.decode(history[pos], pos), d.decode(history[pos], pos))
        block = history[pos + 1 : pos + 6]
        torch.testing.assert_close(
            r.forward(block, pos + 1, all_logits=True), d.forward(block, pos + 1, all_logits=True)
        )
        torch.testing.assert_close(r.tree_forward(tree, pos + 6), d.tree_forward(tree, pos + 6))
    spans = {name: {span for _, span in r.graphs[name]._captures} for name in ("decode", "tree")}
    assert spans == {"decode": {128, r.cache_len}, "tree": {128, r.cache_len}}
    prompt = history[:12]
    for speculative in (None, "ngram"):
        cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True, speculative=speculative)
        assert replayed.generate(prompt, cfg).token_ids == direct.generate(prompt, cfg).token_ids
    # Plain greedy keeps the logits on the GPU (runtime/device_greedy.py): the same ids as
    # the host picking each argmax from logits copied back.
    tok = int(d.forward(prompt, 0).argmax())
    host = [tok]
    for pos in range(len(prompt), len(prompt) + 39):
        host.append(tok := int(d.decode(tok, pos).argmax()))
    assert replayed.generate(prompt, cfg := GenerationConfig(40, ignore_eos=True)).token_ids == host
    assert direct.generate(prompt, cfg).token_ids == host


@needs_gpu
def test_cpp_runtime_runs_cuda_packages(run_bin, gpu_checkpoints, project):
    """aotgen-run on a CUDA package gives the Python runtime's ids: plain greedy with its
    graphs replayed and called directly, and with n-gram speculation (verify replayed)."""
    path = _replay_package("fp32", None, gpu_checkpoints, project)
    engine = Engine.load(path)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, engine.target.vocab_size, (30,), generator=g).tolist()
    runs = [([], None), (["--no-cuda-graphs"], None), (["--lookup", "ngram"], "ngram")]
    for flags, speculative in runs:
        cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True, speculative=speculative)
        want = engine.generate(prompt, cfg).token_ids
        proc = subprocess.run(
            [str(run_bin), str(path), "--prompt-ids", json.dumps(prompt), "--ids"]
            + ["--max-new-tokens", "40", "--ignore-eos", *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["ids"] == want, flags
