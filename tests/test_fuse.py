"""Fusing linears that share an input (passes/fuse.py): fewer ops, the same numbers."""

import pytest
import torch
from torch import nn

from aotgen.model.llama import ModelConfig, Transformer, new_kv_cache
from aotgen.passes.fuse import FuseLinearsPass
from aotgen.passes.quantize import QuantizePass
from aotgen.passes.quantize_options import parse_quantize

aten = torch.ops.aten


class AttentionInputs(nn.Module):
    """q/k/v read x; o reads their sum (a different input: never fused with them)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 16, bias=False)
        self.v_proj = nn.Linear(32, 16, bias=False)
        self.o_proj = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(*x.shape[:-1], 4, 8)  # a view of the fused output's slice
        kv = torch.cat([self.k_proj(x), self.v_proj(x)], dim=-1)
        return self.o_proj(q.flatten(-2) + kv)


def _count(ep, target) -> int:
    return sum(n.target == target for n in ep.graph.nodes)


def test_shared_input_linears_become_one():
    torch.manual_seed(0)
    model = AttentionInputs().eval()
    x = torch.randn(2, 3, 32)
    fuser = FuseLinearsPass()
    ep = fuser(torch.export.export(model, (x,)))
    assert _count(ep, aten.linear.default) == 2  # qkv, o
    assert fuser.fused == {"{q_proj,k_proj,v_proj}"}
    # The separate weights are gone from the program; the fused one is stored instead.
    assert not {"q_proj.weight", "k_proj.weight", "v_proj.weight"} & set(ep.state_dict)
    assert ep.state_dict["q_proj_k_proj_v_proj.weight"].shape == (64, 32)
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.compile(ep.module())(x), model(x), rtol=1e-5, atol=1e-5)


def test_graphs_share_the_fused_tensor_and_patterns_keep_linears_apart():
    model = AttentionInputs().eval()
    fuser = FuseLinearsPass(exclude=("k_proj",))
    a = fuser(torch.export.export(model, (torch.randn(1, 1, 32),)))
    b = fuser(torch.export.export(model, (torch.randn(1, 4, 32),)))
    assert fuser.fused == {"{q_proj,v_proj}"}
    assert a.state_dict["q_proj_v_proj.weight"] is b.state_dict["q_proj_v_proj.weight"]
    assert "k_proj.weight" in a.state_dict


@pytest.mark.parametrize("quantize", [None, {"linear": "int8"}, {"linear": {"int4": {}}}])
def test_fused_then_quantized_model_matches_unfused(quantize):
    """On the real model definition (decode graph): fusing before quantizing changes no
    number, because both schemes quantize each output row on its own."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = Transformer(cfg, cache_len=16).eval()
    tokens, pos = torch.tensor([[3, 5]]), torch.tensor([0, 1])

    def program(fuse: bool):
        with torch.no_grad():
            ep = torch.export.export(model, (tokens, pos, new_kv_cache(cfg, 16)), strict=False)
        if fuse:
            ep = FuseLinearsPass()(ep)
        if quantize:
            ep = QuantizePass(parse_quantize(quantize))(ep)
        return ep

    fused, plain = program(True), program(False)
    assert len(fused.state_dict) < len(plain.state_dict)  # q/k/v and gate/up stored fused
    out_fused = fused.module()(tokens, pos, new_kv_cache(cfg, 16))
    out_plain = plain.module()(tokens, pos, new_kv_cache(cfg, 16))
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-5)
