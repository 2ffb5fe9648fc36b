#!/usr/bin/env bash
# The GPU checks of docs/cuda.md in one run, on a machine with an NVIDIA GPU and a CUDA build
# of torch (`python3`, or $PYTHON): the C++ runtime built against that torch, then
# tests/test_cuda.py beside the builds of the three SmolLM2 CUDA recipes, then, once both are
# done, scripts/gpu_bench.py on the packages alone (another process on the GPU time-slices with
# the bench: a verify step read 8.0 ms against 3.4). With no
# checkpoints/smollm2-135m, the builds use SmolLM2-135M's config and tokenizer from TEMPLATE with
# random weights (speed does not depend on the values; texts and perplexities then mean nothing).
# Logs go to $OUT.
#   bash scripts/gpu_check.sh [TEMPLATE]    # TEMPLATE: a dir with config.json, tokenizer*.json
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/aotgen-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Some CUDA images' own libstdc++ crashes AOTInductor's wrapper at load (docs/cuda.md).
LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)
export LD_PRELOAD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

CKPT=checkpoints/smollm2-135m
if [ ! -f "$CKPT/model.safetensors" ]; then
  TEMPLATE=${1:?no $CKPT: give a dir with its config.json and tokenizer files}
  mkdir -p "$CKPT" && cp "$TEMPLATE"/*.json "$CKPT"/
  "$PY" - "$CKPT" <<'EOF'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
path = sys.argv[1]
LlamaForCausalLM(LlamaConfig.from_pretrained(path)).save_pretrained(path)
print("random weights in", path)
EOF
fi

RECIPES=(smollm2-135m-cuda smollm2-135m-int8-cuda smollm2-135m-int4-cuda)
# The C++ runtime, configured as tests/cpp_build.py does, in the directory its tests reuse.
export AOTGEN_CPP_BUILD_DIR=$PWD/build/cpp-gpu
CPP=$AOTGEN_CPP_BUILD_DIR/default
(cmake -S runtime/cpp -B "$CPP" -DCMAKE_BUILD_TYPE=Release -DAOTGEN_PYTHON="$(command -v "$PY")" &&
  cmake --build "$CPP" -j "$(nproc)" --target aotgen-run) >"$OUT/cpp_build.log" 2>&1 &
cpp=$!
builds=()
for r in "${RECIPES[@]}"; do
  "$PY" -m aotgen build "recipes/$r.yaml" >"$OUT/build-$r.log" 2>&1 &
  builds+=($!)
done
# The torch.compile baseline, compiled now so that its cache serves the bench.
baseline=()
for r in "${RECIPES[@]}"; do baseline+=("recipes/$r.yaml"); done
"$PY" scripts/gpu_bench.py --baseline-only "${baseline[@]}" >"$OUT/baseline.log" 2>&1 &
builds+=($!)
wait "$cpp"
echo "== C++ runtime: $(tail -n 1 "$OUT/cpp_build.log")"
timeout 400 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$OUT/test_cuda.log" 2>&1 &
tests=$!
for pid in "${builds[@]}"; do wait "$pid"; done
for r in "${RECIPES[@]}"; do echo "== $r"; tail -n 3 "$OUT/build-$r.log"; done
wait "$tests"
echo "== tests/test_cuda.py"
tail -n 25 "$OUT/test_cuda.log"
pairs=()
for r in "${RECIPES[@]}"; do pairs+=("recipes/$r.yaml" "artifacts/$r"); done
cpp_run=()
[ -x "$CPP/aotgen-run" ] && cpp_run=(--cpp-run "$CPP/aotgen-run")
"$PY" scripts/gpu_bench.py "${pairs[@]}" "${cpp_run[@]}" --json "$OUT/gpu_bench.json" 2>&1 |
  tee "$OUT/gpu_bench.log"
