"""`device: cuda` packages (issue 3, part 2: the CUDA quantized kernels).

On a machine without a CUDA GPU (this project's CI) only the refusals run: a CUDA build or
a CUDA package fails at once with the reason, before anything is written or loaded. The
GPU tests run where `torch.cuda.is_available()`: build tiny fp32 / int8 / int4 packages for
the GPU and compare every compiled graph with the same graph run eagerly on the GPU
(tight) and with the fp32 model (loose; bounds as in test_quantize.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE
from tiny import make_tiny_checkpoint

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.export.aoti import export_graph, graph_specs
from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
from aotgen.package.build import build
from aotgen.package.manifest import PackageError, target_info
from aotgen.passes.quantize import QuantizePass
from aotgen.passes.quantize_numerics import kernel_problem
from aotgen.passes.quantize_options import parse_quantize
from aotgen.recipe import Recipe, RecipeError, kv_cache_len, parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

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
    fp32 model; the quantized graphs call the CUDA weight-only kernels."""
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
        eager[s.name] = ep.module()
    g = torch.Generator().manual_seed(0)
    for graph, start, length in [("prefill", 0, 11), ("decode", 7, 1), ("verify", 9, 5)]:
        history = torch.randint(0, cfg.vocab_size, (start + length,), generator=g).cuda()
        for c in (*runner.caches, *caches["eager"], *caches["fp32"]):
            c.zero_()
        with torch.no_grad():
            if start:
                runner.forward(history[:start].tolist(), 0)
                prefix = (history[None, :start], torch.arange(start, device="cuda"))
                eager["prefill"](*prefix, caches["eager"])
                model(*prefix, caches["fp32"])
            tokens = history[None, start:]
            pos = torch.arange(start, start + length, device="cuda")
            got = runner.graphs[graph](tokens, pos, runner.caches).float()
            ref_q = eager[graph](tokens, pos, caches["eager"]).float()
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
