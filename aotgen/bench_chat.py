"""`aotgen bench --turns N`: a multi-turn chat, each turn's time to first token with the
conversation so far found in the KV cache (prefix reuse) against the same prompt run whole.

Each turn's prompt is the chat template over every message so far, as a chat client sends
it: the earlier answers come back as text and are encoded again, so the reused prefix is
what re-encoding leaves equal to the ids the engine holds. Two engines of the package take
each turn, one reusing, one running every prompt from position 0, in alternating order;
their answers are compared (greedy: equal unless float rounding breaks a near-tie).

With a GGUF of the same weights, llama.cpp's `llama-server` (its prompt cache on, one slot, a
fresh server per conversation) takes the same prompts, generating as many tokens as aotgen's
answer so that its slot holds what aotgen's cache holds; its time is the server's own
prompt-processing time (`timings.prompt_ms`).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aotgen.bench import PROMPTS_FILE, BenchError
from aotgen.bench_serving import llama_binary
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationResult

Turn = tuple[list[int], GenerationResult, GenerationResult]  # prompt, reused, whole


@dataclass
class TurnRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_whole_ms: float  # median over conversations
    ttft_reused_ms: float
    same_text: bool  # in every conversation
    llama_cpp_ms: float = float("nan")  # llama-server's prompt time, its cache on
    llama_cpp_cached: int = -1  # prompt tokens llama-server did not process again


def _conversation(
    reusing: Engine, whole: Engine, questions: list[str], turns: int, gen_tokens: int, flip: bool
) -> list[Turn]:
    """One chat from an empty cache: per turn (prompt, reused, whole)."""
    reusing.target.cached.clear()
    config = GenerationConfig(max_new_tokens=gen_tokens)
    cold = GenerationConfig(max_new_tokens=gen_tokens, reuse_prefix=False)
    messages: list[dict[str, str]] = []
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": questions[turn % len(questions)]})
        ids = reusing.tokenizer.encode_chat(messages)
        if (turn % 2 == 0) != flip:
            reused, run_whole = reusing.generate(ids, config), whole.generate(ids, cold)
        else:
            run_whole, reused = whole.generate(ids, cold), reusing.generate(ids, config)
        out.append((ids, reused, run_whole))
        messages.append({"role": "assistant", "content": reused.text})
    return out


def bench_chat(
    package: Path,
    turns: int,
    gen_tokens: int,
    runs: int,
    threads: int | None,
    llama_cpp: Path | None = None,
) -> list[TurnRow]:
    """`runs` conversations of `turns` turns over the shipped chat prompts, and with
    `llama_cpp` (a GGUF) llama-server on the same prompts."""
    reusing = Engine.load(package, threads=threads)
    whole = Engine.load(package, threads=threads)
    questions = json.loads(PROMPTS_FILE.read_text())["chat"]
    _conversation(reusing, whole, questions, 1, 4, False)  # warm-up
    chats = [
        _conversation(reusing, whole, questions, turns, gen_tokens, run % 2 == 1)
        for run in range(runs)
    ]
    rows = []
    for turn in range(turns):
        pairs = [chat[turn][1:] for chat in chats]
        reused = [r for r, _ in pairs]
        rows.append(
            TurnRow(
                turn + 1,
                reused[0].prompt_tokens,
                min(r.cached_tokens for r in reused),
                statistics.median(w.prefill_s for _, w in pairs) * 1e3,
                statistics.median(r.prefill_s for r in reused) * 1e3,
                all(r.token_ids == w.token_ids for r, w in pairs),
            )
        )
    if llama_cpp is not None:
        threads = threads or torch.get_num_threads()  # what the engines run at
        timings = [_llama_server_chat(llama_cpp, chats[0], threads) for _ in range(runs)]
        for turn, row in enumerate(rows):
            row.llama_cpp_ms = statistics.median(t[turn][0] for t in timings)
            row.llama_cpp_cached = min(t[turn][1] for t in timings)
    return rows


def _llama_server_chat(gguf: Path, chat: list[Turn], threads: int) -> list[tuple[float, int]]:
    """Per turn (prompt ms, prompt tokens not processed again) from a fresh llama-server."""
    with llama_server(gguf, threads) as url:
        out = []
        for ids, reused, _ in chat:
            n_predict = len(reused.token_ids) + 1
            body = {"prompt": ids, "n_predict": n_predict, "temperature": 0, "cache_prompt": True}
            timings = llama_completion(url, body)["timings"]
            out.append((timings["prompt_ms"], len(ids) - timings["prompt_n"]))
        return out


@contextmanager
def llama_server(gguf: Path, threads: int) -> Iterator[str]:
    """A llama-server on `gguf` (one slot) for the block; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [llama_binary("llama-server"), "-m", gguf, "-t", threads, "-tb", threads]
    cmd += ["-c", 4096, "-np", 1, "--host", "127.0.0.1", "--port", port]
    server = subprocess.Popen(
        [str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def llama_completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's `/completion` answer to `body`."""
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _wait_for(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise BenchError(f"llama-server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise BenchError("llama-server did not answer /health within 120 s")
