"""Distil a shallow draft model from a target checkpoint, for speculative decoding.

    python scripts/distill_draft.py checkpoints/smollm2-135m checkpoints/smollm2-135m-draft4 \
        --layers 4 --samples 16384 --steps 1500 --gen-batch 1024 --device cuda

An experiment, not yet a product feature: on SmolLM2-135M the 2- and 4-layer drafts it made
(H100, 4.2 M sampled tokens, about 5 min each) step at 0.12-0.20 of a target
step on the GPU but agree with the target on only ~0.3-0.4 of greedy chat tokens, a net
loss (docs/speculative.md, "Distilled drafts").

Why: a draft pays off only if it is much cheaper than the target *and* agrees with it. A
quantized copy of the target is as deep as the target, so where a step's cost is its
kernel launches (a GPU at batch 1) it costs as much as the target; the target's first
layers alone agree with it on 5-19 % of greedy chat tokens (SmolLM2-135M, 8-20 of 30
layers, measured). A few layers trained to imitate the target give both.

Data-free, as in Magpie and DistillSpec: the target writes its own training text, each
sample started from the chat template's user-turn prefix, so the text is the kind of
conversation the draft will be asked to predict; the loss is the KL divergence from the
target's next-token distribution at every position. The draft keeps the target's
tokenizer, embeddings and head (frozen), so it is a plain checkpoint of the same
architecture with fewer layers: `speculative: {draft: {checkpoint: DIR}}` builds it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from aotgen.checkpoint.hf import open_checkpoint, write_checkpoint_dir
from aotgen.model.llama import ModelConfig, Transformer, load_model, new_kv_cache
from aotgen.runtime.tokenizer import Tokenizer

FROZEN = ("model.embed_tokens.weight", "lm_head.weight")  # shared with the target


@dataclass(frozen=True)
class DistillConfig:
    layers: int = 4  # draft depth
    samples: int = 8192  # sequences the target writes
    seq_len: int = 256  # tokens per sequence, prefix included
    temperature: float = 0.8  # the target's sampling temperature for its text
    steps: int = 1500  # optimizer steps
    batch: int = 32  # sequences per step
    lr: float = 5e-4
    gen_batch: int = 512  # sequences sampled at once
    holdout: float = 0.05  # share of samples kept out of training to measure agreement
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class DistillReport:
    agreement_before: float  # greedy top-1 agreement with the target, held-out text
    agreement_after: float
    final_loss: float
    tokens: int  # generated training tokens
    seconds: float


def user_turn_prefix(tokenizer: Tokenizer) -> list[int]:
    """Ids of the chat template up to where a user's message begins (Magpie's pre-query
    template); the bos token alone for a checkpoint without a chat template."""
    if tokenizer.chat_template:
        marker = "\x00"
        text = tokenizer.chat_prompt([{"role": "user", "content": marker}])
        return tokenizer.encode(text[: text.index(marker)])
    start = tokenizer.bos_id if tokenizer.bos_id is not None else min(tokenizer.eos_ids, default=0)
    return [start]


def draft_layers(target_layers: int, layers: int) -> list[int]:
    """Target layers the draft starts from: evenly spaced, first and last included."""
    if not 1 <= layers < target_layers:
        raise ValueError(
            f"a draft needs 1..{target_layers - 1} layers (the target has {target_layers}), "
            f"got {layers}"
        )
    if layers == 1:
        return [0]
    return [round(i * (target_layers - 1) / (layers - 1)) for i in range(layers)]


def init_draft(
    hf_config: dict, weights: dict[str, Tensor], layers: int, cache_len: int, device: str
) -> tuple[dict, Transformer]:
    """The draft's HF config and model: the target's embeddings, head and final norm, and
    `layers` of its decoder layers (draft_layers) as the starting point."""
    picked = draft_layers(hf_config["num_hidden_layers"], layers)
    config = {**hf_config, "num_hidden_layers": layers}
    draft_weights = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            if int(index) in picked:
                draft_weights[f"model.layers.{picked.index(int(index))}.{rest}"] = tensor.clone()
        else:
            draft_weights[name] = tensor
    model = load_model(ModelConfig.from_hf(config), draft_weights, cache_len, torch.float32)
    return config, model.to(device)


def forward_batch(model: Transformer, tokens: Tensor) -> Tensor:
    """Logits [B, T, V] for whole sequences from position 0, on a fresh cache."""
    batch, length = tokens.shape
    caches = new_kv_cache(model.config, length, device=tokens.device.type, batch=batch)
    return model(tokens, torch.arange(length, device=tokens.device), caches)


@torch.no_grad()
def sample_corpus(target: Transformer, prefix: list[int], cfg: DistillConfig) -> Tensor:
    """[samples, seq_len] token ids, each row `prefix` and then the target's own sampled
    continuation (temperature `cfg.temperature`)."""
    device = torch.device(cfg.device)
    generator = torch.Generator(device).manual_seed(cfg.seed)
    rows = []
    for start in range(0, cfg.samples, cfg.gen_batch):
        batch = min(cfg.gen_batch, cfg.samples - start)
        tokens = torch.tensor([prefix] * batch, device=device)
        caches = new_kv_cache(target.config, cfg.seq_len, device=device.type, batch=batch)
        logits = target(tokens, torch.arange(len(prefix), device=device), caches)[:, -1]
        out = [tokens]
        for pos in range(len(prefix), cfg.seq_len):
            probs = (logits / cfg.temperature).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            out.append(nxt)
            if pos + 1 < cfg.seq_len:
                logits = target(nxt, torch.tensor([pos], device=device), caches)[:, -1]
        rows.append(torch.cat(out, dim=1))
    return torch.cat(rows)


@torch.no_grad()
def agreement(target: Transformer, draft: Transformer, corpus: Tensor, batch: int) -> float:
    """Share of positions where draft and target pick the same greedy next token."""
    same = total = 0
    for start in range(0, len(corpus), batch):
        tokens = corpus[start : start + batch]
        picks = forward_batch(target, tokens).argmax(-1), forward_batch(draft, tokens).argmax(-1)
        same += int((picks[0] == picks[1]).sum())
        total += tokens.numel()
    return same / max(total, 1)


def train(
    target: Transformer,
    draft: Transformer,
    corpus: Tensor,
    cfg: DistillConfig,
    log: Callable[[str], None] = print,
) -> float:
    """Minimise KL(target || draft) over the corpus; embeddings and head stay frozen."""
    params = [p for n, p in draft.named_parameters() if n not in FROZEN]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, cfg.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to a tenth
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    draft.train()
    loss_value = float("nan")
    for step in range(cfg.steps):
        rows = torch.randint(len(corpus), (cfg.batch,), generator=generator)
        tokens = corpus[rows.to(corpus.device)]
        with torch.no_grad():
            target_logp = forward_batch(target, tokens).log_softmax(-1).flatten(0, 1)
        draft_logp = forward_batch(draft, tokens).log_softmax(-1).flatten(0, 1)
        loss = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        if step % max(1, cfg.steps // 20) == 0 or step == cfg.steps - 1:
            log(f"step {step + 1}/{cfg.steps}: KL {loss_value:.4f}")
    draft.eval().requires_grad_(False)
    return loss_value


def save_draft(out_dir: Path, config: dict, draft: Transformer, source: Path, meta: dict) -> None:
    """An HF-layout checkpoint dir: config, safetensors, the target's tokenizer files."""

    def write(tmp: Path) -> None:
        state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in open_checkpoint(source).tokenizer_files:
            shutil.copy2(f, tmp / f.name)
        (tmp / "distill.json").write_text(json.dumps(meta, indent=2))

    write_checkpoint_dir(out_dir, write)


def distill_draft(
    checkpoint: Path, out_dir: Path, cfg: DistillConfig, log: Callable[[str], None] = print
) -> DistillReport:
    """Target checkpoint dir -> a `cfg.layers`-layer draft checkpoint dir at out_dir."""
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    source = open_checkpoint(checkpoint)
    weights = source.load_weights()
    target_cfg = ModelConfig.from_hf(source.config)
    draft_layers(target_cfg.num_hidden_layers, cfg.layers)  # refuse a bad depth before work
    target = load_model(target_cfg, weights, cfg.seq_len, torch.float32).to(cfg.device)
    prefix = user_turn_prefix(Tokenizer.from_dir(checkpoint))
    if not 0 < len(prefix) < cfg.seq_len:
        raise ValueError(
            f"seq_len {cfg.seq_len} leaves no room after the {len(prefix)}-token prefix"
        )
    log(f"sampling {cfg.samples} x {cfg.seq_len} tokens from the target")
    corpus = sample_corpus(target, prefix, cfg)
    held = max(1, int(len(corpus) * cfg.holdout))
    train_rows, held_rows = corpus[held:], corpus[:held]
    config, draft = init_draft(source.config, weights, cfg.layers, cfg.seq_len, cfg.device)
    before = agreement(target, draft, held_rows, cfg.batch)
    log(f"held-out greedy agreement before training: {before:.3f}")
    loss = train(target, draft, train_rows, cfg, log)
    after = agreement(target, draft, held_rows, cfg.batch)
    log(f"held-out greedy agreement after training: {after:.3f}")
    report = DistillReport(before, after, loss, corpus.numel(), time.perf_counter() - t0)
    meta = {"source": str(checkpoint), "config": asdict(cfg), "report": asdict(report)}
    save_draft(out_dir, config, draft, checkpoint, meta)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the target's HF checkpoint dir")
    parser.add_argument("out_dir", type=Path, help="draft checkpoint dir to write")
    for f in fields(DistillConfig):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(f.default), default=f.default)
    args = vars(parser.parse_args())
    checkpoint, out_dir = args.pop("checkpoint"), args.pop("out_dir")
    report = distill_draft(checkpoint, out_dir, DistillConfig(**args))
    print(f"wrote {out_dir}: {report}")


if __name__ == "__main__":
    main()
