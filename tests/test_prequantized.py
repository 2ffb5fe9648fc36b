"""GPTQ, AWQ, compressed-tensors, FP8 and bitsandbytes checkpoints (checkpoint/prequantized.py,
checkpoint/bnb.py).

GPTQ and AWQ checkpoints are written here as their quantizers write them (the packers follow
AutoGPTQ's `QuantLinear.pack` and AutoAWQ's `WQLinear_GEMM.from_linear`: codes along the inputs
for GPTQ, along the outputs in AWQ's nibble order, GPTQ's zero points stored minus one), from
codes chosen here; reading must give back the weights those codes stand for, (q - z) * s.
compressed-tensors checkpoints are packed by the compressed-tensors library itself, or converted
by it from the AWQ checkpoint, and its own dequantization is the reference. FP8 checkpoints are
checked against compressed-tensors' FP8 block dequantizer and transformers; bitsandbytes ones
are quantized and saved by transformers with bitsandbytes, whose dequantization is the
reference. The model must compute what transformers computes on the weights read, and a
`gguf: keep` package must run the codes themselves as blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_RECIPE
from families import load_reference, make_family_checkpoint, reference_logits
from reference import EagerModel
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint

from aotgen.checkpoint.hf import CheckpointError, open_checkpoint
from aotgen.package.build import build
from aotgen.passes.gguf_keep import BlockIndex
from aotgen.recipe import parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

pytest.importorskip("transformers")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: the column packed at nibble i
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEARS += ("w1", "w2", "w3", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


def _linear_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The weights a quantizer packs: the linears', not the norms', embedding's or routers'."""
    return [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 2)[-2] in LINEARS]


def _input_of(name: str) -> str:
    """The linears reading one input share a name here: q/k/v, gate/up, w1/w3."""
    prefix, linear = name.rsplit(".", 2)[:2]
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}
    return f"{prefix}.{shared.get(linear, linear)}"


def _codes(w: torch.Tensor, bits: int, group: int, sym: bool, min_zero: int):
    """Round-to-nearest codes of w [N, K] in groups of consecutive inputs: q [N, K],
    zero points and float16 scales [N, K / group]. Asymmetric codes get both extreme zero
    points the format stores (GPTQ's original format stores z - 1 unsigned: z >= 1)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    top = (1 << bits) - 1
    if sym:
        scale = (wg.abs().amax(-1) / (top // 2)).half().float()
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / top).half().float()
        zero = (-lo / scale).round().clamp(0, top).int()
        zero[0, 0], zero[-1, -1] = min_zero, top
    q = ((wg / scale[..., None]).round() + zero[..., None]).clamp(0, top).int()
    return q.reshape(n, k), zero, scale


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """[R, C] codes -> int32 [R / per_word, C]: AutoGPTQ's qweight (row j of each run of
    32 / bits at bits * j)."""
    per = 32 // bits
    words = np.zeros((values.shape[0] // per, values.shape[1]), dtype=np.uint32)
    for j in range(per):
        words |= values[j::per].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def _pack_columns(values: np.ndarray, bits: int, order: tuple[int, ...] = ()) -> np.ndarray:
    """[R, C] codes -> int32 [R, C / per_word]: column order[i] of each run at bits * i
    (AutoGPTQ's qzeros in natural order; AutoAWQ's qweight and qzeros in AWQ_ORDER)."""
    per = 32 // bits
    order = order or tuple(range(per))
    words = np.zeros((values.shape[0], values.shape[1] // per), dtype=np.uint32)
    for i in range(per):
        words |= values[:, order[i] :: per].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


# id -> (method, bits, group, symmetric, act-order, GPTQ checkpoint_format, block type kept);
# act-order "input": one order of the inputs per input (GPTQ sorts by the activations' Hessian,
# which q/k/v and gate/up share), "linear": one of its own for every linear
SCHEMES = {
    "gptq-sym4-g32": ("gptq", 4, 32, True, False, "gptq", "Q4_0"),
    "gptq-asym4-g64-v2": ("gptq", 4, 64, False, False, "gptq_v2", "Q4_1"),
    "gptq-sym8-g32": ("gptq", 8, 32, True, False, "gptq", "Q8_0"),
    "gptq-sym4-act-order": ("gptq", 4, 32, True, "input", "gptq", "Q4_0"),
    "gptq-asym4-g32-act-order": ("gptq", 4, 32, False, "linear", "gptq", "Q4_1"),
    "gptq-sym8-act-order": ("gptq", 8, 32, True, "input", "gptq_v2", "Q8_0"),
    "gptq-sym4-g16": ("gptq", 4, 16, True, False, "gptq", None),  # groups a block cannot hold
    "gptq-asym8-per-row": ("gptq", 8, -1, False, False, "gptq", None),
    "awq-g32": ("awq", 4, 32, False, False, None, "Q4_1"),
}


def write_quantized(src: Path, out: Path, scheme: str) -> dict[str, torch.Tensor]:
    """src's checkpoint with its linears quantized and packed by `scheme` into out; returns
    the float32 weights the codes stand for, by the linear's weight name."""
    method, bits, group, sym, act_order, fmt, _ = SCHEMES[scheme]
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    meant: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    for name in _linear_weights(tensors):
        w = tensors.pop(name)
        n, k = w.shape
        size = k if group == -1 else group
        key = _input_of(name) if act_order == "input" else name
        if key not in perms:
            perms[key] = torch.randperm(k, generator=g) if act_order else torch.arange(k)
        perm = perms[key]
        # groups of permuted inputs with act-order
        q, zero, scale = _codes(w[:, perm], bits, size, sym, 1 if fmt == "gptq" else 0)
        inv = torch.argsort(perm)
        q, g_idx = q[:, inv], (torch.arange(k) // size)[inv]
        meant[name] = (q - zero[:, g_idx]).float() * scale[:, g_idx]
        prefix = name.removesuffix(".weight")
        stored = zero - (1 if fmt == "gptq" else 0)
        if method == "gptq":
            tensors[prefix + ".qweight"] = torch.from_numpy(_pack_rows(q.t().numpy(), bits))
            tensors[prefix + ".qzeros"] = torch.from_numpy(_pack_columns(stored.t().numpy(), bits))
            tensors[prefix + ".g_idx"] = g_idx.int()
        else:
            tensors[prefix + ".qweight"] = torch.from_numpy(
                _pack_columns(q.t().numpy(), bits, AWQ_ORDER)
            )
            tensors[prefix + ".qzeros"] = torch.from_numpy(
                _pack_columns(stored.t().numpy(), bits, AWQ_ORDER)
            )
        tensors[prefix + ".scales"] = scale.t().half().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    qc = {"quant_method": method, "bits": bits, "group_size": group}
    if method == "gptq":
        qc |= {"sym": sym, "desc_act": bool(act_order), "checkpoint_format": fmt}
    else:
        qc |= {"zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return meant


def write_float(quantized: Path, out: Path) -> Path:
    """The float checkpoint of what aotgen reads from `quantized`, for transformers."""
    ckpt = open_checkpoint(quantized)
    shutil.copytree(quantized, out)
    save_file(ckpt.load_weights(), str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_compressed(src: Path, out: Path, fmt: str, bits: int, group: int, sym: bool) -> None:
    """src's checkpoint with its linears quantized as llm-compressor writes them: by group,
    or by channel (group 0); weight-only `pack-quantized`, or `int-quantized` int8 weights
    for int8 activations (W8A8)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    half = 1 << (bits - 1)  # compressed-tensors' codes are signed: q - 2^(bits - 1)
    for name in _linear_weights(tensors):
        w = tensors.pop(name)
        q, zero, scale = _codes(w, bits, group or w.shape[1], sym, 0)
        prefix = name.removesuffix(".weight")
        signed, zero_signed = (q - half).to(torch.int8), (zero - half).to(torch.int8)
        if fmt == "pack-quantized":
            tensors[prefix + ".weight_packed"] = pack_to_int32(signed, bits)
            tensors[prefix + ".weight_shape"] = torch.tensor(w.shape)
            if not sym:
                tensors[prefix + ".weight_zero_point"] = pack_to_int32(zero_signed, bits, 0)
        else:
            tensors[prefix + ".weight"] = signed
            if not sym:
                tensors[prefix + ".weight_zero_point"] = zero_signed
        tensors[prefix + ".weight_scale"] = scale.half()
    save_file(tensors, str(out / "model.safetensors"))
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False}
    weights |= {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    activations = None
    if fmt == "int-quantized":
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True}
        activations["strategy"] = "token"
    # the library's dequantizer matches by name: the linears, not the embedding
    group_0 = {"targets": ["re:.*_proj$"], "weights": weights, "input_activations": activations}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group_0}}
    qc |= {"ignore": ["lm_head"], "quantization_status": "compressed"}
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))


def dequantized_by_compressed_tensors(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantization of a checkpoint in its format."""
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

    dequantizer = CompressedTensorsDequantizer(str(ckpt), dtype=torch.float32)
    convert_checkpoint(str(ckpt), str(out), dequantizer, max_workers=1, device="cpu")
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("float") / "tiny", tie=True)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reads_the_weights_the_codes_stand_for(source, tmp_path, scheme):
    meant = write_quantized(source, tmp_path / "q", scheme)
    ckpt = open_checkpoint(tmp_path / "q")
    weights = ckpt.load_weights()
    floats = load_file(str(source / "model.safetensors"))
    assert set(weights) == set(floats)
    for name, w in weights.items():
        if name not in meant:
            assert torch.equal(w, floats[name]), name
        elif SCHEMES[scheme][6] == "Q4_1":  # offsets -z * s rounded to float16 in the blocks
            # |z * s| <= |group minimum| + s <= 1.2 max |w|, rounded by at most 2^-11 of itself
            bound = 2**-11 * 1.2 * meant[name].abs().max()
            assert 0 < (w - meant[name]).abs().max() <= bound, name
        else:
            assert torch.equal(w, meant[name]), name
    kept = SCHEMES[scheme][6]
    if kept is None:
        with pytest.raises(CheckpointError, match="no linear's codes fit a GGUF block type"):
            ckpt.load_gguf_blocks()
        return
    blocks = ckpt.load_gguf_blocks()
    assert set(blocks) == set(meant)
    assert {qtype for qtype, _ in blocks.values()} == {kept}
    note = f"{len(meant)} quantized linears read as float32; their codes as GGUF blocks: {kept}"
    assert note + f" x{len(meant)}" in ckpt.quant_note()
    assert bool(SCHEMES[scheme][4]) == ("in act-order" in ckpt.quant_note())


@pytest.mark.parametrize(
    "family, scheme",
    [
        ("llama", "gptq-sym4-act-order"),
        ("llama", "awq-g32"),
        ("qwen2-tied", "gptq-sym4-g32"),  # biases beside the packed tensors
        ("gptneox-parallel", "gptq-asym4-g64-v2"),
        ("qwen3-moe", "gptq-sym4-g16"),  # every expert packed, the router float
        ("mixtral", "awq-g32"),
    ],
)
def test_model_computes_what_transformers_computes(source, tmp_path, family, scheme):
    src = source if family == "llama" else make_family_checkpoint(tmp_path / "float", family)
    write_quantized(src, tmp_path / "q", scheme)
    reference = load_reference(write_float(tmp_path / "q", tmp_path / "f"))
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    want = reference_logits(reference, ids)
    got = EagerModel(tmp_path / "q", 64).forward(ids, 0)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize(
    "config, phrase",
    [
        ({"quant_method": "hqq"}, "checkpoint quantized with 'hqq'"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes config loads neither 4 nor 8 bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ version"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ with 3 bits"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}},
            },
            "format 'nvfp4-pack-quantized'",
        ),
    ],
)
def test_unread_schemes_are_one_line_errors(source, tmp_path, config, phrase):
    ckpt = Path(shutil.copytree(source, tmp_path / "q"))
    cfg = json.loads((ckpt / "config.json").read_text()) | {"quantization_config": config}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=phrase) as e:
        open_checkpoint(ckpt)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "scheme, gathers", [("gptq-sym4-act-order", 1), ("gptq-asym4-g32-act-order", 3)]
)
def test_act_order_blocks_hold_the_rows(source, tmp_path, scheme, gathers):
    """A fused q/k/v weight of act-order linears is found in their blocks: one segment (one
    gather of the activations) where q/k/v share the input order, one each where they do not;
    each segment's blocks, taken back to the weight's input order, are its rows."""
    write_quantized(source, tmp_path / "q", scheme)
    ckpt = open_checkpoint(tmp_path / "q")
    index = BlockIndex(ckpt.load_gguf_blocks(), ckpt.block_input_orders())
    weights = ckpt.load_weights()
    qkv = torch.cat([weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    segments = index.segments(qkv)
    assert len(segments) == gathers
    assert [s.stop - s.start for s in segments] == ([128] if gathers == 1 else [64, 32, 32])
    for seg in segments:
        values = gguf.quants.dequantize(seg.raw, gguf.GGMLQuantizationType[seg.qtype])
        rows = torch.empty(seg.stop - seg.start, qkv.shape[1])
        rows[:, torch.from_numpy(seg.order)] = torch.from_numpy(values.reshape(rows.shape))
        assert torch.equal(rows, qkv[seg.start : seg.stop])
        assert not np.array_equal(seg.order, np.arange(qkv.shape[1]))


def test_kept_package_runs_the_codes(source, tmp_path, project):
    """Act-order asymmetric GPTQ 4-bit as Q4_1 blocks, run on activations gathered in each
    linear's input order (q/k/v and gate/up in orders of their own): the package's logits are
    transformers' on the weights the codes stand for, and greedy decoding gives its tokens."""
    write_quantized(source, tmp_path / "q", "gptq-asym4-g32-act-order")
    raw = {"checkpoint": str(tmp_path / "q"), **TINY_RECIPE, "quantize": {"gguf": "keep"}}
    report = build(parse_recipe(raw, "gptq-keep", Path(".")), project)
    manifest = json.loads((report.path / "manifest.json").read_text())
    kept = manifest["models"]["target"]["quantization"]["weights"]
    assert set(kept.values()) == {"Q4_1"}  # every linear, q/k/v and gate/up fused
    assert {name.split(".")[2] for name in kept} == {"0", "1"}
    assert "Q4_1 x14; 14 in act-order, their inputs permuted" in report.notes[0]
    reference = load_reference(write_float(tmp_path / "q", tmp_path / "f"))
    engine = Engine.load(report.path)
    ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    want = reference_logits(reference, ids)
    got = engine.target.forward(ids, 0, all_logits=True)  # verify graph calls, then decode
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    out = engine.generate(ids, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    expected = list(ids)
    for _ in range(12):
        expected.append(int(reference_logits(reference, expected)[-1].argmax()))
    assert out.token_ids == expected[len(ids) :]


# id -> (format, bits, group, symmetric, block type kept)
COMPRESSED = {
    "w4a16-g32": ("pack-quantized", 4, 32, True, "Q4_0"),
    "w4a16-asym-g64": ("pack-quantized", 4, 64, False, "Q4_1"),
    "w8a16-channel": ("pack-quantized", 8, 0, True, "Q8_0"),
    "w8a16-asym-g32": ("pack-quantized", 8, 32, False, None),
    "w8a8-channel": ("int-quantized", 8, 0, True, "Q8_0"),
}


@pytest.mark.parametrize("case", COMPRESSED)
def test_compressed_tensors_read_as_the_library_dequantizes(source, tmp_path, case):
    """Against compressed-tensors' own dequantization, which multiplies in the scales' float16
    (so within float16 rounding: 2^-11 of a weight), and the Q4_1 offsets' rounding."""
    fmt, bits, group, sym, kept = COMPRESSED[case]
    pytest.importorskip("compressed_tensors")
    write_compressed(source, tmp_path / "ct", fmt, bits, group, sym)
    want = dequantized_by_compressed_tensors(tmp_path / "ct", tmp_path / "deq")
    ckpt = open_checkpoint(tmp_path / "ct")
    got = ckpt.load_weights()
    assert set(got) == set(want)
    for name, w in want.items():
        tol = 2**-10 * w.abs().max() if name.rsplit(".", 2)[-2] in LINEARS else 0
        assert (got[name] - w).abs().max() <= tol, name
    if kept is None:
        with pytest.raises(CheckpointError, match="no linear's codes fit"):
            ckpt.load_gguf_blocks()
    else:
        assert {qtype for qtype, _ in ckpt.load_gguf_blocks().values()} == {kept}


def test_awq_read_as_compressed_tensors_converts_it(source, tmp_path):
    """The AWQ checkpoint converted by compressed-tensors (its AutoAWQ converter, an
    independent reading of AWQ's packing): the same weights as the AWQ checkpoint read
    directly, and the library's dequantization of them."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    write_quantized(source, tmp_path / "awq", "awq-g32")
    converter = AutoAWQConverter.from_pretrained(str(tmp_path / "awq"))
    convert_checkpoint(str(tmp_path / "awq"), str(tmp_path / "ct"), converter, 1, "cpu")
    direct = open_checkpoint(tmp_path / "awq").load_weights()
    converted = open_checkpoint(tmp_path / "ct").load_weights()
    want = dequantized_by_compressed_tensors(tmp_path / "ct", tmp_path / "deq")
    for name, w in want.items():
        assert torch.equal(direct[name], converted[name]), name
        tol = 2**-10 * w.abs().max() if name.rsplit(".", 2)[-2] in LINEARS else 0
        assert (direct[name] - w).abs().max() <= tol, name


E4M3_MAX = 448.0
# id -> (quant_method, scales: "tensor" | "channel" | (rows, inputs) a block)
FP8 = {
    "fp8-blocks": ("fp8", (48, 48)),  # cut short at 64, 32 and 128: the last block is partial
    "fp8-blocks-32": ("fp8", (32, 32)),
    "fp8-tensor": ("fp8", "tensor"),  # AutoFP8 and vLLM: weight_scale, as one number
    "ct-fp8-channel": ("compressed-tensors", "channel"),
    "ct-fp8-blocks": ("compressed-tensors", (48, 32)),
}


def write_fp8(src: Path, out: Path, case: str) -> dict[str, torch.Tensor]:
    """src's checkpoint with its linears as float8 e4m3 values and scales, as Qwen's and
    DeepSeek's FP8 releases (`quant_method: fp8`) or llm-compressor (`float-quantized`) write
    them; returns the float32 weights they stand for."""
    method, layout = FP8[case]
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    meant: dict[str, torch.Tensor] = {}
    for name in _linear_weights(tensors):
        w = tensors.pop(name)
        n, k = w.shape
        rows, cols = {"tensor": (n, k), "channel": (1, k)}.get(layout, layout)
        grid = -(-n // rows), -(-k // cols)
        padded = torch.zeros(grid[0] * rows, grid[1] * cols)
        padded[:n, :k] = w
        amax = padded.reshape(grid[0], rows, grid[1], cols).abs().amax(dim=(1, 3))
        scale = amax / E4M3_MAX
        if method == "compressed-tensors":  # llm-compressor keeps the weight's dtype for scales
            scale = scale.to(torch.bfloat16).float()
        full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        meant[name] = q.float() * full
        prefix = name.removesuffix(".weight")
        tensors[name] = q
        if method == "fp8" and layout == "tensor":  # AutoFP8's layout: one scale, and the input's
            tensors[prefix + ".weight_scale"] = scale.reshape(())
            tensors[prefix + ".input_scale"] = torch.tensor(0.05)
        elif method == "fp8":
            tensors[prefix + ".weight_scale_inv"] = scale
        else:
            tensors[prefix + ".weight_scale"] = scale.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    if method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        if layout != "tensor":
            qc["weight_block_size"] = list(layout)
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        weights |= (
            {"strategy": "channel"}
            if layout == "channel"
            else {"strategy": "block", "block_structure": list(layout)}
        )
        group_0 = {"targets": ["re:.*_proj$"], "weights": weights, "input_activations": None}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized"}
        qc |= {"config_groups": {"g": group_0}, "quantization_status": "compressed"}
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return meant


@pytest.mark.parametrize("case", FP8)
def test_fp8_read_as_the_libraries_dequantize(source, tmp_path, case):
    """Exactly the weights the float8 values and scales stand for; blocks cut short at the
    edges as compressed-tensors' FP8 block dequantizer cuts them; compressed-tensors'
    float-quantized as its own dequantizer reads it (which rounds to its bfloat16 scales'
    dtype: 2^-8 of a weight)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
        FP8BlockDequantizer,
    )

    method, layout = FP8[case]
    meant = write_fp8(source, tmp_path / "fp8", case)
    ckpt = open_checkpoint(tmp_path / "fp8")
    got = ckpt.load_weights()
    assert set(got) == set(load_file(str(source / "model.safetensors")))
    for name, w in meant.items():
        assert torch.equal(got[name], w), name
    if method == "fp8" and layout != "tensor":
        dequantizer = FP8BlockDequantizer.from_pretrained(
            str(tmp_path / "fp8"), weight_block_size=layout, dtype=torch.float32
        )
        # its process(), not convert_checkpoint(), which cannot save a cut-short block's view
        want, tol = dequantizer.process(load_file(str(tmp_path / "fp8" / "model.safetensors"))), 0
    elif method == "compressed-tensors":
        want = dequantized_by_compressed_tensors(tmp_path / "fp8", tmp_path / "deq")
        tol = 2**-8
    else:
        want, tol = {}, 0
    for name, w in want.items():
        assert (got[name] - w).abs().max() <= tol * w.abs().max(), name
    with pytest.raises(CheckpointError, match="no linear's codes fit a GGUF block type"):
        ckpt.load_gguf_blocks()


@pytest.mark.parametrize("case", ["fp8-blocks-32", "ct-fp8-channel"])
def test_fp8_model_computes_what_transformers_computes(source, tmp_path, case):
    """transformers loads FP8 checkpoints on a CPU by dequantizing them to the scales'
    dtype (float32 here); its blocks must divide the weight."""
    write_fp8(source, tmp_path / "fp8", case)
    reference = load_reference(tmp_path / "fp8")
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    want = reference_logits(reference, ids)
    got = EagerModel(tmp_path / "fp8", 64).forward(ids, 0)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


# id -> transformers' BitsAndBytesConfig arguments
BNB = {
    "nf4-double": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


def write_bnb(src: Path, out: Path, case: str) -> Path:
    """src's checkpoint quantized by bitsandbytes through transformers and saved by it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(**BNB[case], bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=config, dtype=torch.float32, device_map="cpu"
    )
    model.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out)
    return out


def dequantized_by_bitsandbytes(ckpt: Path) -> dict[str, torch.Tensor]:
    """bitsandbytes' own dequantization of every quantized linear in a saved checkpoint."""
    from bitsandbytes import functional as bnb

    tensors = load_file(str(ckpt / "model.safetensors"))
    out = {}
    for name in _linear_weights(tensors):
        if name + ".absmax" in tensors:
            state = {
                k.removeprefix(name + "."): v
                for k, v in tensors.items()
                if k.startswith(name + ".")
            }
            quant_state = bnb.QuantState.from_dict(state, device=torch.device("cpu"))
            out[name] = bnb.dequantize_4bit(tensors[name], quant_state)
        elif name.removesuffix(".weight") + ".SCB" in tensors:
            scb = tensors[name.removesuffix(".weight") + ".SCB"]
            out[name] = bnb.int8_vectorwise_dequant(tensors[name], scb)
    return out


@pytest.mark.parametrize("case", BNB)
def test_bitsandbytes_read_as_the_library_dequantizes(source, tmp_path, case):
    """Checkpoints quantized and saved by transformers with bitsandbytes: every linear reads
    as bitsandbytes itself dequantizes it, bit for bit; the rest as saved."""
    pytest.importorskip("bitsandbytes")
    ckpt = open_checkpoint(write_bnb(source, tmp_path / "bnb", case))
    got = ckpt.load_weights()
    want = dequantized_by_bitsandbytes(tmp_path / "bnb")
    floats = load_file(str(source / "model.safetensors"))
    assert set(got) == set(floats) and len(want) == 14
    for name, w in got.items():
        assert torch.equal(w, want.get(name, floats[name])), name
    assert "bitsandbytes" in ckpt.quant_note() and "14 quantized linears" in ckpt.quant_note()
    with pytest.raises(CheckpointError, match="no linear's codes fit a GGUF block type"):
        ckpt.load_gguf_blocks()


@pytest.mark.parametrize("case", ["nf4-double", "fp4"])
def test_bitsandbytes_model_computes_what_transformers_computes(source, tmp_path, case):
    """transformers runs a 4-bit bitsandbytes model on a CPU by dequantizing each linear (on a
    CPU with AVX512-BF16 bitsandbytes would repack them to compute in bfloat16: turned off)."""
    pytest.importorskip("bitsandbytes")
    reference = load_reference(write_bnb(source, tmp_path / "bnb", case))
    for module in reference.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    want = reference_logits(reference, ids)
    got = EagerModel(tmp_path / "bnb", 64).forward(ids, 0)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def write_mxfp4(out: Path, seed: int = 0) -> Path:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 as OpenAI releases them: random codes
    and block exponents (2^-9 to 2^-5, weights up to 0.19) in `*_blocks` / `*_scales`, the
    rest float."""
    import transformers

    make_family_checkpoint(out, "gpt-oss-mxfp4", seed=seed)
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = tensors.pop(name).shape  # [E, in, out] as transformers holds it
        tensors[f"{name}_blocks"] = torch.randint(
            0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g
        )
        tensors[f"{name}_scales"] = torch.randint(
            118, 123, (e, rows, cols // 32), dtype=torch.uint8, generator=g
        )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = transformers.Mxfp4Config().to_dict()
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mxfp4_experts_read_as_transformers_dequantizes(tmp_path):
    """gpt-oss's MXFP4 experts: aotgen reads each `_blocks` / `_scales` pair as the tensor
    transformers' own conversion gives, exactly; the model then computes what transformers,
    which dequantizes MXFP4 on a CPU, computes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt_dir = write_mxfp4(tmp_path / "mxfp4")
    tensors = load_file(str(ckpt_dir / "model.safetensors"))
    ckpt = open_checkpoint(ckpt_dir)
    got = ckpt.load_weights()
    stems = [n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks")]
    assert len(stems) == 4 and "MXFP4" in ckpt.quant_note()
    for stem in stems:
        want = convert_moe_packed_tensors(
            tensors[f"{stem}_blocks"], tensors[f"{stem}_scales"], dtype=torch.float32
        )
        assert torch.equal(got[stem], want), stem
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    want = reference_logits(load_reference(ckpt_dir), ids)
    got_logits = EagerModel(ckpt_dir, 64).forward(ids, 0)
    assert ((got_logits - want).norm() / want.norm()).item() < 1e-5


def test_damaged_mxfp4_blocks_are_one_line(tmp_path):
    ckpt_dir = write_mxfp4(tmp_path / "mxfp4")
    tensors = load_file(str(ckpt_dir / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = tensors[
        "model.layers.0.mlp.experts.down_proj_scales"
    ][..., :1].contiguous()
    save_file(tensors, str(ckpt_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj: MXFP4 blocks .* do not fit"):
        open_checkpoint(ckpt_dir).load_weights()
