"""Tensor parallelism as a build pass: shard the model per rank before export.

    parallel: {tensor: 2}                                   # default plan for the architecture
    parallel: {tensor: 2, plan: {"*.q_proj": colwise, ...}}  # or an explicit one

The pass works on `nn.Module`s, before export, in the spirit of gpt-fast's `tp.py` and of
`torch.distributed.tensor.parallel` plans: a plan maps module-name globs to a style.

- `colwise` (q/k/v, gate/up): each rank keeps a contiguous slice of the output rows, i.e.
  its own heads / KV heads / MLP columns. The model sizes heads from the weights, so a
  shard with fewer heads runs through the unchanged model code.
- `rowwise` (o, down): each rank keeps the matching input columns and computes a partial
  sum, which `_functional_collectives.all_reduce(x, "sum", group)` adds up. The module is
  swapped for a `RowParallelLinear` (an `nn.Linear` whose forward all-reduces) under the
  same name, so parameter names stay the HF ones and the model definition is untouched.
- `replicate` (embedding, lm_head, norms): every rank holds the full tensor. The vocab is
  small next to the cost of a collective over gloo (vocab × hidden is 28 M of SmolLM2's
  135 M parameters); vocab-parallel would add an all-gather of the logits per step.

Quantization is a graph pass on the exported program, so it composes with sharding for
free: it sees each rank's (smaller) `aten.linear` nodes and quantizes them like any other.

All ranks are exported and compiled in one process against a fake process group
(`fake_process_group`); the group's name is baked into the compiled code and recorded in
the manifest so the runtime can register its real group under it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol

from aotgen.model.config import (
    COHERE,
    COHERE2,
    NEMOTRON,
    PER_HEAD_QK_NORMS,
    PHI,
    STABLELM,
    STARCODER2,
)
from aotgen.model.llama import ModelConfig, Transformer
from aotgen.recipe import RecipeError, check_keys, matched_names

STYLES = ("colwise", "rowwise", "replicate")
PARALLEL_KEYS = ("tensor", "plan")

LLAMA_PLAN: dict[str, str] = {
    "model.embed_tokens": "replicate",
    "*.q_proj": "colwise",
    "*.k_proj": "colwise",
    "*.v_proj": "colwise",
    "*.o_proj": "rowwise",
    "*.gate_proj": "colwise",
    "*.up_proj": "colwise",
    "*.down_proj": "rowwise",
    "lm_head": "replicate",
}
# GPT-NeoX's fused query_key_value holds each head's q, k, v rows together, so a colwise
# (contiguous rows) shard is a whole set of heads.
GPT_NEOX_PLAN: dict[str, str] = {
    "gpt_neox.embed_in": "replicate",
    "*.query_key_value": "colwise",
    "*.attention.dense": "rowwise",
    "*.dense_h_to_4h": "colwise",
    "*.dense_4h_to_h": "rowwise",
    "embed_out": "replicate",
}
# (column-parallel inputs, row-parallel output) of each block: both sharded or neither.
BLOCKS = {
    "self_attn": (("q_proj", "k_proj", "v_proj"), "o_proj"),
    "mlp": (("gate_proj", "up_proj"), "down_proj"),
}
# Per architecture whose names differ: (the layers' module path, its blocks).
ARCH_BLOCKS = {
    "GPTNeoXForCausalLM": (
        "gpt_neox.layers",
        {
            "attention": (("query_key_value",), "dense"),
            "mlp": (("dense_h_to_4h",), "dense_4h_to_h"),
        },
    ),
    PHI: (
        "model.layers",
        {"self_attn": (("q_proj", "k_proj", "v_proj"), "dense"), "mlp": (("fc1",), "fc2")},
    ),
    STARCODER2: ("model.layers", {"self_attn": BLOCKS["self_attn"], "mlp": (("c_fc",), "c_proj")}),
    NEMOTRON: (
        "model.layers",
        {"self_attn": BLOCKS["self_attn"], "mlp": (("up_proj",), "down_proj")},
    ),
}
ARCH_BLOCKS["ArceeForCausalLM"] = ARCH_BLOCKS["ApertusForCausalLM"] = ARCH_BLOCKS[NEMOTRON]


def _blocks_plan(blocks: dict[str, tuple[tuple[str, ...], str]]) -> dict[str, str]:
    """The default plan of a family named by its blocks: each block's inputs colwise, its
    output rowwise, the embeddings and the head replicated."""
    plan = {"model.embed_tokens": "replicate", "lm_head": "replicate"}
    for block, (cols, row) in blocks.items():
        plan |= {f"*.{block}.{col}": "colwise" for col in cols}
        plan[f"*.{block}.{row}"] = "rowwise"
    return plan


DEFAULT_PLANS: dict[str, dict[str, str]] = {
    "LlamaForCausalLM": LLAMA_PLAN,
    "GemmaForCausalLM": LLAMA_PLAN,
    "MistralForCausalLM": LLAMA_PLAN,
    "Qwen2ForCausalLM": LLAMA_PLAN,
    "Qwen3ForCausalLM": LLAMA_PLAN,
    "Gemma2ForCausalLM": LLAMA_PLAN,
    "Gemma3ForCausalLM": LLAMA_PLAN,
    "VaultGemmaForCausalLM": LLAMA_PLAN,
    "OlmoForCausalLM": LLAMA_PLAN,
    "Phi3ForCausalLM": LLAMA_PLAN,
    "SmolLM3ForCausalLM": LLAMA_PLAN,
    "GraniteForCausalLM": LLAMA_PLAN,
    "GraniteMoeHybridForCausalLM": LLAMA_PLAN,  # Granite 4.0 without experts
    "Glm4ForCausalLM": LLAMA_PLAN,
    "Ernie4_5ForCausalLM": LLAMA_PLAN,
    "Exaone4ForCausalLM": LLAMA_PLAN,
    "SeedOssForCausalLM": LLAMA_PLAN,
    "HeliumForCausalLM": LLAMA_PLAN,
    "MinistralForCausalLM": LLAMA_PLAN,
    "Ministral3ForCausalLM": LLAMA_PLAN,
    "HunYuanDenseV1ForCausalLM": LLAMA_PLAN,
    "GPTNeoXForCausalLM": GPT_NEOX_PLAN,
    STABLELM: LLAMA_PLAN,
    COHERE: LLAMA_PLAN,
    COHERE2: LLAMA_PLAN,
    # Phi, StarCoder2, Nemotron, Arcee: the Llama layout's paths, their own block names.
    **{arch: _blocks_plan(b) for arch, (path, b) in ARCH_BLOCKS.items() if path == "model.layers"},
}


@dataclass(frozen=True)
class TensorParallel:
    """A recipe's validated `parallel:` section."""

    world_size: int
    plan: dict[str, str] | None = None  # None: the architecture's default plan


def parse_parallel(raw: dict[str, Any] | None) -> TensorParallel | None:
    """`parallel: {tensor: N, plan: {...}}` → TensorParallel; None when there is none."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RecipeError(f"parallel: expected a mapping like {{tensor: 2}}, got {raw!r}")
    check_keys("parallel", raw, list(PARALLEL_KEYS))
    n = raw.get("tensor", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RecipeError(f"parallel.tensor: must be a positive integer (ranks), got {n!r}")
    plan = raw.get("plan")
    if plan is not None:
        if not isinstance(plan, dict) or not plan:
            raise RecipeError(
                f"parallel.plan: expected a mapping of module globs to styles, got {plan!r}"
            )
        for pattern, style in plan.items():
            if style not in STYLES:
                raise RecipeError(
                    f"parallel.plan: {pattern!r}: unknown style {style!r}; "
                    f"valid: {', '.join(STYLES)}"
                )
    return TensorParallel(n, dict(plan) if plan else None)


def default_plan(cfg: ModelConfig) -> dict[str, str]:
    try:
        return dict(DEFAULT_PLANS[cfg.architecture])
    except KeyError:
        raise RecipeError(
            f"parallel: no default tensor-parallel plan for {cfg.architecture}; "
            "give one as parallel.plan"
        ) from None


def valid_world_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """TP sizes that split heads, KV heads and the MLP evenly."""
    dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    return [n for n in range(1, limit + 1) if all(d % n == 0 for d in dims)]


def _module_styles(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name → style for every Linear/Embedding; unplanned modules are replicated."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise RecipeError(
                f"parallel.plan: {pattern!r}: unknown style {style!r}; valid: {', '.join(STYLES)}"
            )
        matched = matched_names(
            "parallel.plan", pattern, names, "Linear or Embedding module", "*.q_proj"
        )
        for n in matched:
            if styles.get(n, style) != style:
                raise RecipeError(
                    f"parallel.plan: {n} is matched as both {styles[n]} and {style} "
                    f"(pattern {pattern!r}); make the patterns disjoint"
                )
            styles[n] = style
    return {n: styles.get(n, "replicate") for n in names}


def resolve_plan(model: Transformer, tp: TensorParallel) -> dict[str, str]:
    """The recipe's plan (or the architecture's default), checked against the model and
    world size; returns module name → style. Call before compiling anything."""
    if model.config.qk_norm_across_heads:
        raise RecipeError(
            f"{model.config.architecture} normalises q and k across all heads, which a rank "
            "holding some heads cannot do alone: build it without `parallel`"
        )
    if model.config.qk_norm and model.config.architecture in PER_HEAD_QK_NORMS:
        raise RecipeError(
            f"{model.config.architecture}'s q/k norms have a weight per head, which aotgen does "
            "not shard: build it without `parallel`"
        )
    if model.config.conv_kernel or model.config.recurrent:
        raise RecipeError(
            f"{model.config.architecture}'s convolution layers are not sharded: build it "
            "without `parallel`"
        )
    if model.config.attention_sinks:
        raise RecipeError(
            f"{model.config.architecture}'s attention sinks (a logit per head) are not sharded: "
            "build it without `parallel`"
        )
    if model.config.latent_attention:
        raise RecipeError(
            f"{model.config.architecture}'s latent attention (one cached row every head reads) "
            "is not sharded: build it without `parallel`"
        )
    if model.config.num_experts:
        raise RecipeError(
            f"{model.config.architecture} is a mixture of experts, which aotgen does not shard "
            "(no expert parallelism yet): build it without `parallel`"
        )
    return validate_plan(model, tp.plan or default_plan(model.config), tp.world_size)


def validate_plan(model: Transformer, plan: dict[str, str], world_size: int) -> dict[str, str]:
    """Check a plan against the model and world size; returns module name → style."""
    cfg = model.config
    styles = _module_styles(model, plan)
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name in ("lm_head", "embed_out"):
            if styles[name] != "replicate":
                raise RecipeError(
                    f"parallel.plan: {name} must be replicate (vocab-parallel embedding/head "
                    f"is not supported), got {styles[name]}"
                )
    layers, blocks = ARCH_BLOCKS.get(cfg.architecture, ("model.layers", BLOCKS))
    for i in range(cfg.num_hidden_layers):
        for block, (cols, row) in blocks.items():
            prefix = f"{layers}.{i}.{block}."
            got = tuple(styles[prefix + c] for c in cols) + (styles[prefix + row],)
            sharded = ("colwise",) * len(cols) + ("rowwise",)
            if got not in (sharded, ("replicate",) * len(got)):
                pairs = ", ".join(f"{n}={s}" for n, s in zip((*cols, row), got, strict=True))
                raise RecipeError(
                    f"parallel.plan: layer {i} {block} mixes styles ({pairs}); shard "
                    f"{', '.join(cols)} colwise and {row} rowwise, or replicate all of them"
                )
    if world_size > 1:
        dims = {
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size,
        }
        bad = {k: v for k, v in dims.items() if v % world_size}
        if bad:
            what = ", ".join(f"{k}={v}" for k, v in bad.items())
            sizes = ", ".join(map(str, valid_world_sizes(cfg)))
            raise RecipeError(
                f"parallel.tensor={world_size} does not divide {what}: every rank needs the "
                f"same number of heads, KV heads and MLP columns. Tensor sizes that work for "
                f"this model: {sizes}"
            )
    return styles


class RowParallelLinear(nn.Linear):
    """A row-parallel shard: this rank's partial product, summed over ranks."""

    group_name: str = ""

    def forward(self, x: Tensor) -> Tensor:
        return funcol.all_reduce(F.linear(x, self.weight, self.bias), "sum", self.group_name)


def _shard(t: Tensor, dim: int, rank: int, world_size: int) -> Tensor:
    # A fresh tensor, not a view: a view's storage offset would be baked into the compiled
    # code's constant table and make the ranks' code differ.
    return torch.tensor_split(t, world_size, dim=dim)[rank].clone(
        memory_format=torch.contiguous_format
    )


def shard_model(
    model: Transformer,
    styles: dict[str, str],
    rank: int,
    world_size: int,
    group_name: str,
) -> Transformer:
    """Rank `rank`'s shard (`styles` from `resolve_plan`): new modules, replicated tensors
    shared with `model`, row-parallel outputs all-reduced over the group `group_name`."""
    # Deep-copy the modules but not the tensors: the replicated ones stay shared.
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    shard = copy.deepcopy(model, memo)
    for name, style in styles.items():
        if style == "replicate":
            continue
        parent_name, _, child = name.rpartition(".")
        parent = shard.get_submodule(parent_name)
        old: nn.Linear = getattr(parent, child)
        has_bias = old.bias is not None
        weight = _shard(old.weight, 0 if style == "colwise" else 1, rank, world_size)
        with torch.device("meta"):  # no init: the shard's tensors are assigned below
            if style == "colwise":
                new = nn.Linear(old.in_features, weight.shape[0], bias=has_bias)
            else:
                new = RowParallelLinear(weight.shape[1], old.out_features, bias=has_bias)
                new.group_name = group_name
        new.weight = nn.Parameter(weight, requires_grad=False)
        if has_bias:  # colwise: slice it; rowwise: add it once, on rank 0
            bias = _shard(old.bias, 0, rank, world_size) if style == "colwise" else old.bias
            if style == "rowwise" and rank:
                bias = torch.zeros_like(bias)
            new.bias = nn.Parameter(bias, requires_grad=False)
        setattr(parent, child, new)
    return shard.eval().requires_grad_(False)


def rank_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """What one rank holds: its share of heads, KV heads and MLP columns (KV cache shape)."""
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=cfg.num_key_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )


def plan_summary(styles: dict[str, str]) -> dict[str, str]:
    """Per-layer names folded into globs, for the manifest: `model.layers.*.mlp.up_proj`."""
    return {re.sub(r"\.layers\.\d+\.", ".layers.*.", n): s for n, s in styles.items()}


@contextmanager
def fake_process_group(world_size: int) -> Iterator[str]:
    """Compile every rank in this one process: a fake group stands in for the real one.

    Yields the group's name, which the compiled collectives refer to at run time.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialized in the build process; "
            "build tensor-parallel packages from a plain (non-torchrun) process"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
