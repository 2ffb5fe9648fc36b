"""The sparse MLP of mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
FlexOlmo, Granite MoE, gpt-oss, LFM2-MoE, ERNIE 4.5, Hunyuan, Mellum, DeepSeek-V2, and
DeepSeek-V3's routing (DeepSeek-V3, GLM-4.7-Flash, GLM-4.5, dots.llm1, Solar Open, K-EXAONE).

A router (`gate`, one logit per expert) picks each token's `num_experts_per_tok` experts by
softmax probability; their SwiGLU MLPs' outputs are summed, weighted by those probabilities
(renormalised over the chosen experts where the config says `norm_topk_prob`, always for
Mixtral and Granite MoE). Qwen2-MoE adds a shared expert on every token, scaled by a sigmoid
gate; Granite's, Hunyuan's, ERNIE 4.5's and DeepSeek-V3's add theirs ungated. A per-expert
bias shifts the choice, not the weights: added to the softmax probabilities (ERNIE 4.5) or to
sigmoid scores (LFM2-MoE, DeepSeek-V3); DeepSeek-V3 first keeps the groups of experts whose two
best scores sum highest, DeepSeek-V2 (softmax) those whose best one is highest; both scale
the weights by `routed_scaling_factor`.

The experts are held stacked, as transformers 5 holds them: `experts.gate_up_proj [E, 2f, d]`
(each expert's gate rows, then its up rows) and `experts.down_proj [E, d, f]`; checkpoints
store them one expert at a time (Granite MoE: stacked, under its own names), and
`stack_experts` stacks (or renames) them at load. kernels/moe.py runs them.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from aotgen.kernels import moe
from aotgen.model.config import (
    DEEPSEEK_MOE,
    DEEPSEEK_V2,
    ERNIE4_5_MOE,
    GPT_OSS,
    HUNYUAN_MOE,
    LFM2,
    ModelConfig,
)
from aotgen.model.layers import GatedMLP


class Experts(nn.Module):
    """The stacked experts: `gate_up_proj [E, 2f, d]`, `down_proj [E, d, f]`, with
    `cfg.expert_biases` their biases `gate_up_proj_bias [E, 2f]` (gate, then up) and
    `down_proj_bias [E, d]`; the activation is SwiGLU, gpt-oss's clamped form where
    `cfg.swiglu_limit` > 0 (kernels/moe.py, `swiglu`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        biased = cfg.expert_biases
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f)) if biased else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, d)) if biased else None
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        return moe.run_experts(
            x,
            weights,
            ids,
            self.gate_up_proj,
            self.down_proj,
            gate_up_bias=self.gate_up_proj_bias,
            down_bias=self.down_proj_bias,
            limit=self.limit,
            alpha=self.alpha,
        )


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.sigmoid, self.scale = cfg.router_sigmoid, cfg.routed_scaling_factor
        self.groups, self.top_groups = cfg.router_groups, cfg.router_top_groups
        self.group_rank = cfg.router_group_rank
        # The renormalisation's: LFM2-MoE's, DeepSeek-V3's (nothing against a softmax's sum).
        self.eps = 1e-6 if cfg.architecture in LFM2 else 1e-20
        self.norm_min = cfg.router_norm_min
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        if cfg.expert_bias:  # shifts which experts are picked, not their weights
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)
        self.experts = Experts(cfg)
        self.shared = cfg.shared_expert_intermediate_size > 0
        self.gated = self.shared and cfg.shared_expert_gated
        if self.shared:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        if self.gated:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(self.gate(rows).float())
        y = self.experts(rows, weights, ids)
        if self.shared:
            shared = self.shared_expert(rows)
            gate = torch.sigmoid(self.shared_expert_gate(rows)) if self.gated else 1.0
            y = y + gate * shared
        return y.reshape(x.shape)

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's experts and their weights, from the router's logits."""
        bias = getattr(self, "expert_bias", None)
        # Softmax probabilities, or sigmoid scores (LFM2-MoE, DeepSeek-V3).
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        choice = scores if bias is None else scores + bias.float()
        if self.groups > 1:  # DeepSeek-V3, and DeepSeek-V2's group_limited_greedy
            choice = self.best_groups(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.normalise:
            total = weights.sum(-1, keepdim=True)
            total = total.clamp(min=self.norm_min) if self.norm_min else total + self.eps
            weights = weights / total
        return weights * self.scale if self.scale != 1.0 else weights, ids

    def best_groups(self, choice: Tensor) -> Tensor:
        """`choice` with every expert outside the `top_groups` best groups at -inf; a group
        is ranked by the sum of its `group_rank` best scores (DeepSeek-V3: two, V2: one)."""
        grouped = choice.unflatten(-1, (self.groups, -1))
        rank = grouped.topk(self.group_rank, dim=-1).values.sum(-1)
        kept = rank.topk(self.top_groups, dim=-1).indices
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter(-1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


# Checkpoint names of one expert's projections: Mixtral's w1 (gate), w3 (up), w2 (down) under
# `block_sparse_moe`, the others' gate_proj / up_proj / down_proj under `mlp`.
_EXPERT = re.compile(
    r"^(.*\.layers\.\d+)\.(mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down"}
# Granite MoE stores the experts stacked already (its gate and up rows fused), under its names.
_GRANITE = {
    "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
    "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
}


def stack_experts(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert checkpoint tensors stacked into each layer's `experts.gate_up_proj` and
    `experts.down_proj`; Mixtral's `block_sparse_moe` named `mlp`. Checkpoints already in the
    stacked layout (transformers 5 in memory) pass through."""
    if not cfg.num_experts:
        return weights
    if cfg.architecture == GPT_OSS:
        return _gpt_oss_experts(weights)
    if cfg.architecture in (*DEEPSEEK_MOE, DEEPSEEK_V2, ERNIE4_5_MOE, HUNYUAN_MOE):
        weights = _router_and_shared_names(weights)
    out: dict[str, Tensor] = {}
    layers: dict[str, dict[str, dict[int, Tensor]]] = {}
    mlp_of: dict[str, str] = {}
    for name, tensor in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            layer, sep, rest = name.partition(".block_sparse_moe.")
            if sep:  # Mixtral's and Granite MoE's router, Granite MoE's experts
                name = f"{layer}.{_GRANITE.get(sep[1:] + rest, 'mlp.' + rest)}"
            out[name] = tensor
            continue
        layer, block, index, proj = match.groups()
        part = _PART.get(proj, "down")
        if block == "feed_forward":  # LFM2-MoE's experts stay under feed_forward
            mlp_of[layer] = block
        layers.setdefault(layer, {}).setdefault(part, {})[int(index)] = tensor
    for layer, parts in layers.items():
        got = [sorted(parts.get(p, {})) for p in ("gate", "up", "down")]
        if any(g != list(range(cfg.num_experts)) for g in got):
            raise ValueError(
                f"checkpoint: {layer} has experts {got[0]} (gate) {got[1]} (up) {got[2]} "
                f"(down), the config says {cfg.num_experts}"
            )
        gate, up, down = (
            torch.stack([parts[p][e] for e in range(cfg.num_experts)])
            for p in ("gate", "up", "down")
        )
        mlp = mlp_of.get(layer, "mlp")
        out[f"{layer}.{mlp}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{layer}.{mlp}.experts.down_proj"] = down
    return out


# The per-expert bias on the choice: DeepSeek-V3's (under `gate.`, or K-EXAONE's beside it), and
# ERNIE 4.5's `[1, E]` (under `gate.` in transformers 5, not in the original checkpoints).
_EXPERT_BIAS = re.compile(
    r"\.mlp\.(gate\.|gate\.moe_statics\.|moe_statics\.)?e_score_correction_bias$"
)


def _router_and_shared_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """DeepSeek-V3's and ERNIE 4.5's router bias and shared experts (`shared_experts`), and
    Hunyuan's router (`gate.wg`) and shared MLP (`shared_mlp`), under the names SparseMoE gives
    them."""
    out = {}
    for name, tensor in weights.items():
        if _EXPERT_BIAS.search(name):
            name, tensor = _EXPERT_BIAS.sub(".mlp.expert_bias", name), tensor.flatten()
        name = name.replace(".mlp.gate.wg.", ".mlp.gate.")
        for shared in (".mlp.shared_experts.", ".mlp.shared_mlp."):
            name = name.replace(shared, ".mlp.shared_expert.")
        out[name] = tensor
    return out


def _gpt_oss_experts(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """gpt-oss's experts as the others': its stacked `gate_up_proj [E, d, 2f]` holds gate and
    up as interleaved columns (and its bias [E, 2f] likewise), its `down_proj` is `[E, f, d]`,
    both transposed against `F.linear`'s weights; its router is `mlp.router`."""
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        stem, sep, leaf = name.partition(".mlp.")
        if not sep:
            out[name] = tensor
        elif leaf in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
            gate_up = tensor if leaf.endswith("bias") else tensor.transpose(1, 2)
            out[name] = torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1).contiguous()
        elif leaf == "experts.down_proj":
            out[name] = tensor.transpose(1, 2).contiguous()
        else:
            out[f"{stem}.mlp.{leaf.replace('router.', 'gate.', 1)}"] = tensor
    return out
