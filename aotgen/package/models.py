"""checkpoint → the package's models (the target, and a draft when the recipe speculates),
each with the graph passes it gets, ready to export; and GPTQ's calibration run on them.

A draft is the target's first layers, the target itself, or another checkpoint with the
same vocabulary; each model has its own pass instances, so their notes and manifest
entries stay apart.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.export import ExportedProgram

from aotgen.checkpoint.hf import Checkpoint, open_checkpoint
from aotgen.export.aoti import GraphSpec, calibration_spec, export_graph, graph_specs
from aotgen.kernels import attention
from aotgen.model.config import LFM2
from aotgen.model.llama import ModelConfig, Transformer, load_model, model_class, new_kv_cache
from aotgen.model.rope import for_context
from aotgen.passes.fuse import FuseLinearsPass
from aotgen.passes.gguf_keep import BlockIndex, KeepGGUF
from aotgen.passes.keep_experts import keep_experts
from aotgen.passes.lora import LoraAdapter, merge_adapter
from aotgen.passes.quantize import QuantizePass, quantize_passes
from aotgen.passes.quantize_experts import quantize_experts, routers
from aotgen.passes.quantize_latent import quantize_latent
from aotgen.passes.quantize_options import check_patterns, parse_quantize
from aotgen.recipe import Recipe, RecipeError
from aotgen.runtime.tokenizer import Tokenizer

CALIBRATION_MAX_TOKENS = 16384


@dataclass
class ModelBuild:
    """One model of the package (the target, or a draft) ready to export."""

    role: str
    model: Transformer
    config: ModelConfig
    graphs: list[GraphSpec]
    # ExportedProgram -> ExportedProgram transforms, applied to each graph in order.
    graph_passes: list[Callable[[ExportedProgram], ExportedProgram]] = field(default_factory=list)
    gguf: KeepGGUF | None = None  # `quantize: {gguf: keep}`: the file's blocks (passes/pack.py)

    @property
    def quantizer(self) -> QuantizePass | None:
        """The model's quantization pass, if any (it reports notes and a manifest entry)."""
        return next((p for p in self.graph_passes if isinstance(p, QuantizePass)), None)


def recipe_kv_cache(cfg: ModelConfig, recipe: Recipe) -> list[Tensor]:
    """A KV cache shaped, typed and placed as the recipe's graphs take it. A cache narrower
    than the model's dtype is read by the attention kernel in the few-row graphs and in a
    softcapped prefill (as matmuls it does not compile), and the kernel needs whole vectors
    of head_dim."""
    if recipe.kv_dtype != recipe.dtype and cfg.head_dim % attention.DIM_MULTIPLE:
        raise RecipeError(
            f"kv_cache_dtype {recipe.kv_dtype}: the attention kernel that reads it needs a "
            f"head_dim that is a multiple of {attention.DIM_MULTIPLE}, and {cfg.architecture}'s "
            f"is {cfg.head_dim}; drop kv_cache_dtype"
        )
    dtype = getattr(torch, recipe.kv_dtype)
    return new_kv_cache(cfg, recipe.cache_len, dtype, recipe.device, 1, ring_cells(cfg, recipe))


def ring_cells(cfg: ModelConfig, recipe: Recipe) -> int | None:
    """The ring length of the model's sliding layers' cache, or of its linear-attention
    layers' states (model/qwen3_5.py); None where it keeps none."""
    if cfg.recurrent:
        return recipe.state_cells(cfg.linear_conv_kernel)
    if not cfg.has_sliding_layers:
        return None
    return recipe.ring_cells(cfg.sliding_window)


def ring_window(cfg: ModelConfig) -> int | None:
    """The positions before p that a ring must still hold for a sequence to go on at p: a
    sliding layer's window, or the linear-attention layers' convolution (whose state after
    p - 1 is among them)."""
    return cfg.linear_conv_kernel if cfg.recurrent else cfg.sliding_window


def check_recurrent(cfg: ModelConfig, recipe: Recipe) -> None:
    """What a model with recurrent states (Qwen3.5's linear attention) cannot be built as:
    its kernel is a CPU kernel, its convolution reads float rows of the cache, and a state is
    the sum of a sequence, so a token tree's rows or a draft writing into the target's cells
    would need states of their own. (The states stay float32 in a bfloat16 cache.)"""
    if not cfg.recurrent:
        return
    share = (recipe.speculative or {}).get("share_kv")
    problems = [  # (the recipe asks it, why not, what to change)
        (recipe.device != "cpu", f"device {recipe.device}: its kernel runs on CPU", "device: cpu"),
        (recipe.kv_dtype == "int8", "an int8 cache: its convolution reads float rows",
         "kv_cache_dtype: bfloat16"),
        ("onnx" in recipe.formats, "ONNX graphs: no ONNX operator runs it", "formats: [aoti]"),
        (recipe.tree_nodes > 0, "a tree graph: each row would need a state of its own",
         "no tree_nodes"),
        (bool(share), "a draft on the target's cache: it would overwrite the target's states",
         "speculative.share_kv: false"),
    ]  # fmt: skip
    for problem, why, fix in problems:
        if problem:
            raise RecipeError(
                f"{cfg.architecture}'s linear-attention layers cannot be built with {why}; "
                f"use {fix}"
            )


def _layer_index(name: str) -> int | None:
    parts = name.split(".")  # model.layers.N.… (Llama layout), gpt_neox.layers.N.…
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def _same_vocab(a: Checkpoint, b: Checkpoint) -> None:
    """Draft and target must tokenize identically, or verification compares nonsense."""
    va = json.loads((a.path / "tokenizer.json").read_text())["model"]["vocab"]
    vb = json.loads((b.path / "tokenizer.json").read_text())["model"]["vocab"]
    if va != vb:
        raise RecipeError(
            f"draft checkpoint {b.path} has a different vocabulary from the target {a.path} "
            f"({len(vb)} vs {len(va)} tokens, or different ids): speculative decoding needs "
            "the same tokenizer"
        )


def graph_passes(
    recipe: Recipe, quantize: dict[str, Any] | None
) -> list[Callable[[ExportedProgram], ExportedProgram]]:
    """One model's passes, in order: fuse linears (unless a quantize pattern names them
    apart), then quantize."""
    passes: list[Callable[[ExportedProgram], ExportedProgram]] = []
    quantizers = quantize_passes(quantize, recipe.device)
    if recipe.compile.fuse_linears:
        o = quantizers[0].options if quantizers else None
        exclude = (*o.skip, *(p for p, _ in o.overrides)) if o else ()
        passes.append(FuseLinearsPass(exclude))
    return passes + quantizers


def keep_gguf(
    recipe: Recipe,
    quantize: dict[str, Any] | None,
    ckpt: Checkpoint,
    indexes: dict[Path, BlockIndex],
) -> KeepGGUF | None:
    """`quantize: {gguf: keep}`: the checkpoint's kept blocks (indexed once per checkpoint in
    `indexes`), after checking the package can run them (the CPU packed kernels, float32)."""
    options = parse_quantize(quantize)
    if options is None or options.gguf != "keep":
        return None
    problems = [
        (recipe.device != "cpu", f"device {recipe.device}: the block kernels are CPU kernels"),
        (recipe.dtype != "float32", f"dtype {recipe.dtype}: the blocks dequantize to float32"),
        (not recipe.compile.packed_linears, "compile.packed_linears is off: they run the blocks"),
        ("onnx" in recipe.formats, "formats onnx: ONNX has no operator for GGUF blocks"),
    ]
    for problem, why in problems:
        if problem:
            raise RecipeError(f"quantize.gguf: keep cannot build this recipe: {why}")
    if ckpt.path not in indexes:
        indexes[ckpt.path] = BlockIndex(ckpt.load_gguf_blocks(), ckpt.block_input_orders())
    return KeepGGUF(indexes[ckpt.path], integer_dot=options.activations == "int8")


def merged_weights(
    ckpt: Checkpoint, adapters: list[LoraAdapter]
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The checkpoint's config and weights with its LoRA adapters merged (passes/lora.py)."""
    cfg = ModelConfig.from_hf(ckpt.config)
    weights = ckpt.load_weights()
    cls = model_class(cfg)
    for adapter in adapters:
        if merge_adapter(weights, adapter, cls.EMBED, cls.HEAD, cfg.tie_word_embeddings):
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    return cfg, weights


def prepare_models(
    recipe: Recipe, ckpt: Checkpoint, adapters: list[LoraAdapter] | None = None
) -> list[ModelBuild]:
    """checkpoint → model(s): the target, plus the draft when the recipe speculates (a draft
    made of the target's layers has its adapters too)."""
    cfg, weights = merged_weights(ckpt, adapters or [])
    cfg = for_context(cfg, recipe.max_seq_len)
    check_recurrent(cfg, recipe)
    _check_ring(cfg, recipe)
    quantize, int8_experts = _experts_quantize(cfg, recipe.quantize)
    graphs = graph_specs(
        recipe.prefill_chunk,
        recipe.verify_k,
        recipe.tree_nodes,
        recipe.max_batch,
        recipe.score_graph,
    )
    indexes: dict[Path, BlockIndex] = {}  # `gguf: keep`: one row index per checkpoint
    models = [
        ModelBuild(
            "target",
            _load(cfg, weights, recipe, int8_experts),
            cfg,
            graphs,
            graph_passes(recipe, quantize),
            keep_gguf(recipe, quantize, ckpt, indexes),
        )
    ]
    check_patterns(parse_quantize(recipe.quantize), _weight_names(models[0].model), "quantize")
    _quantize_latent(models[0], quantize)
    _keep_experts(models[0])
    draft = (recipe.speculative or {}).get("draft")
    if draft:
        # The draft never verifies. On the target's cache it never prefills, and it drafts
        # for a batch of sequences at once (runtime/batch_draft.py); on its own cache each
        # sequence catches up on its own accepted tokens, so it drafts one at a time.
        skip = ["verify", "tree", "batch_verify", "score"]
        skip += ["prefill"] if recipe.speculative.get("share_kv") else ["batch_decode"]
        draft_graphs = [g for g in graphs if g.name not in skip]
        dcfg, dweights = _draft_weights(draft, ckpt, cfg, weights)
        dcfg = for_context(dcfg, recipe.max_seq_len)
        check_recurrent(dcfg, recipe)
        dquantize, dint8_experts = _experts_quantize(dcfg, draft.get("quantize"))
        dckpt = open_checkpoint(draft["checkpoint"]) if "checkpoint" in draft else ckpt
        models.append(
            ModelBuild(
                "draft",
                _load(dcfg, dweights, recipe, dint8_experts),
                dcfg,
                draft_graphs,
                graph_passes(recipe, dquantize),
                keep_gguf(recipe, dquantize, dckpt, indexes),
            )
        )
        dnames = _weight_names(models[1].model)
        check_patterns(parse_quantize(draft.get("quantize")), dnames, "speculative.draft.quantize")
        _quantize_latent(models[1], dquantize)
        _keep_experts(models[1])
    return models


def _experts_quantize(
    cfg: ModelConfig, quantize: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, bool]:
    """A mixture of experts' `quantize:`: its linears as asked, the routers kept float
    (passes/quantize_experts.py); returns the mapping and whether the experts go int8 (when
    the linears are quantized)."""
    options = parse_quantize(quantize)
    if not cfg.num_experts or options is None:
        return quantize, False
    if options.gguf:  # the experts keep their blocks too (_keep_experts)
        return quantize, False
    if options.activations == "int8":
        raise RecipeError(
            f"quantize.activations: int8 does not apply to the experts of {cfg.architecture} (a "
            "mixture of experts): use quantize: {linear: int8} (experts int8 per channel), or "
            "{gguf: keep, activations: int8} on a GGUF checkpoint"
        )
    skip = [*options.skip, *routers(cfg.shared_expert_gated, cfg.architecture in LFM2)]
    return {**quantize, "skip": skip}, options.linear is not None


def _check_ring(cfg: ModelConfig, recipe: Recipe) -> None:
    """`sliding_cache: ring` shapes sliding-window layers' caches: on a model without them it
    would change nothing, and the recipe likely names the wrong checkpoint."""
    if recipe.sliding_cache == "ring" and not cfg.has_sliding_layers:
        raise RecipeError(
            f"sliding_cache ring: {cfg.architecture} has no sliding-window layers, so it changes "
            "nothing; drop sliding_cache"
        )


def _weight_names(model: torch.nn.Module) -> list[str]:
    """The names a quantize pattern may match: the linears' and embeddings' module paths
    first, then every module path and weight name."""
    modules = [(n, m) for n, m in model.named_modules() if n]
    linears = [n for n, m in modules if isinstance(m, torch.nn.Linear | torch.nn.Embedding)]
    weights = [n for n, _ in (*model.named_parameters(), *model.named_buffers())]
    return [*linears, *(n for n, _ in modules), *weights]


def _load(
    cfg: ModelConfig, weights: dict[str, Tensor], recipe: Recipe, int8_experts: bool
) -> Transformer:
    model = load_model(cfg, weights, recipe.cache_len, getattr(torch, recipe.dtype))
    if int8_experts:
        quantize_experts(model)
    return model.to(recipe.device)


def _keep_experts(mb: ModelBuild) -> None:
    """`gguf: keep` on a mixture of experts: the experts on the file's blocks too (the graph
    pass sees linears only: passes/keep_experts.py)."""
    if mb.gguf is not None:
        keep_experts(mb.model, mb.gguf)


def _quantize_latent(mb: ModelBuild, quantize: dict[str, Any] | None) -> None:
    """Latent attention's `kv_b_proj` as int8 rows when the linears are quantized (the graph
    pass cannot see it: passes/quantize_latent.py), reported by the quantize pass."""
    options = parse_quantize(quantize)
    if mb.quantizer is None or options is None or options.linear is None:
        return
    mb.quantizer.note_module_weights(quantize_latent(mb.model, options.skip), "int8 per row")


def _draft_weights(
    draft: dict[str, Any], ckpt: Checkpoint, cfg: ModelConfig, weights: dict[str, Tensor]
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The draft's config and weights: its own checkpoint, the target's first layers, or
    the target itself."""
    if "checkpoint" in draft:
        dckpt = open_checkpoint(draft["checkpoint"])
        _same_vocab(ckpt, dckpt)
        return ModelConfig.from_hf(dckpt.config), dckpt.load_weights()
    if "layers" in draft:
        n = draft["layers"]
        if n >= cfg.num_hidden_layers:
            raise RecipeError(
                f"draft layers={n} must be fewer than the target's {cfg.num_hidden_layers}"
            )
        # Self-speculation: the target's first n layers with its final norm and head.
        dcfg = dataclasses.replace(cfg, num_hidden_layers=n)
        return dcfg, {k: v for k, v in weights.items() if (_layer_index(k) or 0) < n}
    return cfg, weights


def calibrate(mb: ModelBuild, recipe: Recipe, tokenizer: Tokenizer) -> None:
    """GPTQ's calibration: run the model's prefill graph, after the passes that precede
    quantization (so the weights are the tensors the graphs will hold), over the
    calibration text in prefill-sized chunks, each from position 0."""
    quantizer = mb.quantizer
    spec = calibration_spec(recipe.prefill_chunk)
    cache = recipe_kv_cache(mb.config, recipe)
    ep = export_graph(mb.model, spec, cache)
    for graph_pass in mb.graph_passes[: mb.graph_passes.index(quantizer)]:
        ep = graph_pass(ep)
    text = quantizer.options.calibration
    ids = tokenizer.encode(text.read_text())[:CALIBRATION_MAX_TOKENS]
    chunks = [ids[i : i + spec.max_tokens] for i in range(0, len(ids), spec.max_tokens)]
    chunks = [c for c in chunks if len(c) >= spec.min_tokens]
    if not chunks:
        raise RecipeError(
            f"quantize.calibration: {text} holds {len(ids)} tokens; GPTQ needs text, "
            "ideally thousands of tokens"
        )
    device = recipe.device
    batches = [
        (torch.tensor([c], device=device), torch.arange(len(c), device=device), cache)
        for c in chunks
    ]
    quantizer.calibrate(ep, batches, sum(map(len, chunks)))
