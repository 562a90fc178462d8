#!/usr/bin/env bash
# GPU benchmarks of the trainer, one script, < 6 minutes on a single H200:
#   1. MFU of gpt-1b@v1 (~1.3B parameters) and llama-1b@v1 (~1.1B, GQA 32/4 heads, SwiGLU, RoPE) on one GPU,
#      bf16 autocast (target >= 0.50);
#   2. the trainer_overhead comparison on one GPU (nccl): a GPT-2-small-shaped model, trainyard trainer vs a
#      minimal hand-written loop, same model / data / batch (target tokens/s ratio >= 0.97).
# Usage: bench/gpu/run.sh   (from the repository root, with the venv active or at .venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu/run.sh: no CUDA device visible (torch %s)" % torch.__version__)
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PYEOF
mkdir -p "${OUT:-bench/gpu/out}"
echo "== MFU, gpt-1b@v1, 1 GPU"
timeout 200 "$PY" bench/gpu/mfu.py --steps 14 --micro-batch 8 --accumulation 2 --seq 2048 \
  --json "${OUT:-bench/gpu/out}/mfu-gpt-1b.json"
echo "== MFU, llama-1b@v1, 1 GPU"
timeout 200 "$PY" bench/gpu/mfu.py --model llama-1b@v1 --steps 14 --micro-batch 8 --accumulation 2 --seq 2048 \
  --json "${OUT:-bench/gpu/out}/mfu-llama-1b.json"
echo "== trainer overhead, 1 GPU"
timeout 150 "$PY" bench/trainer_overhead/run.py --device cuda --worlds 1 --steps 24 --repeats 1 \
  --model-json '{"vocabSize": 50304, "nLayers": 12, "nHeads": 12, "dModel": 768, "maxSeqLen": 1024}' \
  --batch-json '{"sequenceLength": 1024, "microBatchSize": 16, "globalBatchSize": 32}'
