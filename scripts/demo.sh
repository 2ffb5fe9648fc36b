#!/usr/bin/env bash
# Fresh machine → SmolLM2-135M compiled package → an answer, in one command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
AOTGEN=.venv/bin/aotgen
[ -f checkpoints/smollm2-135m/config.json ] || $AOTGEN import-gguf smollm2 checkpoints/smollm2-135m
$AOTGEN build recipes/smollm2-135m.yaml
$AOTGEN inspect artifacts/smollm2-135m
$AOTGEN run artifacts/smollm2-135m --chat "What is the capital of France?"
