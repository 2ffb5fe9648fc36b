"""Eager PyTorch reference: the same model definition run without compilation."""

from __future__ import annotations

from pathlib import Path

import torch

from aotgen.checkpoint.hf import open_checkpoint
from aotgen.model.llama import ModelConfig, Transformer, load_model, new_kv_cache
from aotgen.recipe import kv_cache_len
from aotgen.runtime.cached_tokens import CachedTokens


class EagerModel:
    def __init__(self, checkpoint: Path, cache_len: int, dtype: torch.dtype = torch.float32):
        ckpt = open_checkpoint(checkpoint)
        self.config = ModelConfig.from_hf(ckpt.config)
        weights = ckpt.load_weights()
        self.model: Transformer = load_model(self.config, weights, cache_len, dtype)
        self.cache_len = cache_len
        self.reset()

    def reset(self) -> None:
        self.caches = new_kv_cache(self.config, self.cache_len)

    @torch.no_grad()
    def forward(self, tokens: list[int], start_pos: int) -> torch.Tensor:
        t = torch.tensor([tokens])
        return self.model(t, torch.arange(start_pos, start_pos + len(tokens)), self.caches)[0]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.reset()
        tok = int(self.forward(prompt, 0)[-1].argmax())
        out, pos = [tok], len(prompt)
        while len(out) < n:
            tok = int(self.forward([tok], pos)[-1].argmax())
            out.append(tok)
            pos += 1
        return out


class EagerRunner(EagerModel):
    """The eager model behind the runtime's `ModelRunner` interface, so the runtime's own
    generation loops (plain and speculative) can run against the reference."""

    shares_cache = False  # eager_engine(share_kv=True) hands a draft the target's cache
    tree_len = 0  # eager_engine(tree_nodes=N): the tree graph's rows
    device = torch.device("cpu")  # where the model runs (a CUDA runner decodes greedy there)

    def __init__(self, checkpoint: Path, cache_len: int):
        super().__init__(checkpoint, cache_len)
        self.vocab_size = self.config.vocab_size
        self.cached = CachedTokens(1)  # never written: every prompt runs from position 0

    def forward(
        self, tokens: list[int], start_pos: int, all_logits: bool = False, slot: int = 0
    ) -> torch.Tensor:
        assert slot == 0, "the eager runner holds one sequence"
        logits = super().forward(tokens, start_pos)
        return logits if all_logits else logits[-1]

    def decode(self, token: int, pos: int, slot: int = 0) -> torch.Tensor:
        assert slot == 0, "the eager runner holds one sequence"
        return super().forward([token], pos)[-1]

    def share_prefix(self, slot: int, tokens: list[int]) -> int:
        """One row, never recorded: nothing to share."""
        return self.cached.prefix(slot, tokens)

    @torch.no_grad()
    def tree_forward(self, tree, start: int) -> torch.Tensor:
        """The tree graph's contract, eagerly: unpadded, node i at slot start + i."""
        assert len(tree) <= self.tree_len, f"a tree of {len(tree)} nodes, {self.tree_len} rows"
        positions = start + torch.tensor(tree.depths)
        return self.model(torch.tensor([tree.tokens]), positions, self.caches, tree.mask())[0]


def eager_engine(
    target: Path,
    draft: Path | None,
    max_seq_len: int,
    verify_k: int,
    share_kv: bool = False,
    tree_nodes: int = 0,
):
    """A runtime `Engine` whose models are eager references; with `share_kv` the draft runs
    on the first layers of the target's cache, as a package built with share_kv does."""
    from aotgen.runtime.engine import Engine
    from aotgen.runtime.tokenizer import Tokenizer

    cache_len = kv_cache_len(max_seq_len, verify_k, tree_nodes)
    target_runner = EagerRunner(target, cache_len)
    target_runner.tree_len = tree_nodes
    draft_runner = EagerRunner(draft, cache_len) if draft else None
    if draft_runner and share_kv:
        draft_runner.caches = target_runner.caches[: len(draft_runner.caches)]
        draft_runner.shares_cache = True
    return Engine(Tokenizer.from_dir(target), target_runner, draft_runner, max_seq_len, verify_k)


def check_conversation(printed: list[dict], package: Path, lines: list[str], config) -> None:
    """The turns `run --interactive --json` printed (either runtime), each user line the next
    turn of one chat, against the Python engine on the same chat: each turn's prompt ids and
    cached count equal its, and its ids those of a cold run (reuse off, a second engine). Each
    answer goes back into the chat without its reasoning, as a client sends it. A chat past
    the context loses its oldest turns (a message and its answer) until the next prompt and
    `max_new_tokens` fit."""
    from dataclasses import replace

    from aotgen.runtime.engine import Engine
    from aotgen.runtime.reasoning import split_reasoning, thinking_of

    engine, cold = Engine.load(package), Engine.load(package)
    messages: list[dict[str, str]] = []
    assert len(printed) == len(lines)
    for line, out in zip(lines, printed, strict=True):
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.encode_chat(messages)
        while len(ids) + config.max_new_tokens > engine.max_seq_len:
            del messages[:2]
            ids = engine.tokenizer.encode_chat(messages)
        result = engine.generate(ids, config)
        assert out["prompt_ids"] == ids
        assert out["cached_tokens"] == result.cached_tokens
        cold_ids = cold.generate(ids, replace(config, reuse_prefix=False)).token_ids
        assert out["ids"] == result.token_ids == cold_ids
        thinking = thinking_of(engine.tokenizer, ids)
        content = result.text if thinking is None else split_reasoning(result.text, thinking)[1]
        messages.append({"role": "assistant", "content": content})
    assert 0 < printed[1]["cached_tokens"] <= printed[2]["cached_tokens"]


def reset_caches(*runners) -> None:
    """Zero the runners' KV caches and forget what their rows held: a test that calls graphs
    directly writes the cache behind the runner's record (runtime/cached_tokens.py), which a
    later generate would otherwise trust."""
    for runner in runners:
        for c in runner.caches:
            c.zero_()
        runner.cached.clear()


CHAT_TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def r1_thinking_template() -> str:
    """DeepSeek-R1's chat template as the model ships it, thinking always on (the stored
    variant closes the reasoning unless `enable_thinking`): the prompt opens the reasoning, so
    a tiny random model's whole answer is reasoning."""
    source = (CHAT_TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    close = "{% if not enable_thinking %}{{- '</think>' -}}{% endif %}"
    assert close in source
    return source.replace(close, "")


def with_chat_template(package: Path, dest: Path, template: str) -> Path:
    """A copy of `package` at `dest` whose tokenizer config has the chat template
    `template` (a file of tests/data/chat_templates, or the template's source), its manifest
    hashed again."""
    import json
    import shutil

    from aotgen.package.manifest import read_manifest, write_manifest

    copy = Path(shutil.copytree(package, dest))
    config_path = copy / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    is_file = template.endswith(".jinja")
    config["chat_template"] = (CHAT_TEMPLATES / template).read_text() if is_file else template
    config_path.write_text(json.dumps(config))
    write_manifest(copy, read_manifest(copy))
    return copy


def with_generation_config(package: Path, dest: Path, values: dict) -> Path:
    """A copy of `package` at `dest` whose generation_config.json also holds `values`, its
    manifest hashed again."""
    import json
    import shutil

    from aotgen.package.manifest import read_manifest, write_manifest

    copy = Path(shutil.copytree(package, dest))
    path = copy / "tokenizer" / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(config | values))
    write_manifest(copy, read_manifest(copy))
    return copy


# generation_config.json's sampling values in the tests of `aotgen run` and `aotgen-run` taking
# them (test_model_sampling.py, test_cpp_runtime.py).
MODEL_SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 3, "repetition_penalty": 1.5}


def model_sampling_answers(engine, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The engine's answers (12 tokens, eos ignored, seed 5) with every MODEL_SAMPLING value,
    with top_k 0 instead of the model's, and greedy; checked to differ from each other and from
    top_k 0 without the model's repetition penalty, so each value taken or not shows."""
    from aotgen.runtime.engine import GenerationConfig
    from aotgen.runtime.rules import Penalties
    from aotgen.runtime.sampling import SamplingParams

    def answer(top_k: int, temperature: float = 0.8, repetition: float = 1.5) -> list[int]:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, seed=5)
        config = GenerationConfig(12, sampling, ignore_eos=True, penalties=Penalties(repetition))
        return engine.generate(ids, config).token_ids

    model, own_top_k, greedy = answer(3), answer(0), answer(0, temperature=0.0, repetition=1.0)
    assert (
        len({tuple(model), tuple(own_top_k), tuple(answer(0, repetition=1.0)), tuple(greedy)}) == 4
    )
    return model, own_top_k, greedy
