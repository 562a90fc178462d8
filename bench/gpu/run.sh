#!/usr/bin/env bash
# GPU benchmarks of the trainer, one script, < 5 minutes on a single H200:
#   1. MFU of gpt-1b@v1 (~1.3B parameters) on one GPU, bf16 autocast (target >= 0.50);
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
echo "== MFU, gpt-1b@v1, 1 GPU"
timeout 240 "$PY" bench/gpu/mfu.py --steps 16 --micro-batch 8 --accumulation 2 --seq 2048
echo "== trainer overhead, 1 GPU"
timeout 150 "$PY" bench/trainer_overhead/run.py --device cuda --worlds 1 --steps 24 --repeats 1 \
  --model-json '{"vocabSize": 50304, "nLayers": 12, "nHeads": 12, "dModel": 768, "maxSeqLen": 1024}' \
  --batch-json '{"sequenceLength": 1024, "microBatchSize": 16, "globalBatchSize": 32}'
