#!/usr/bin/env bash
# CUDA correctness and throughput on a GPU machine (≤ 8 minutes): one team of two ~0.36B agents built from a
# config (MAGRPO updates), the same team as LoRA adapters on one base (reference KL on), peak GPU memory of 2 and
# 4 agents (full vs LoRA), sampling with the shared-prefix cache against the repeated one (same tokens in float32),
# and tokens/s and updates/s. DDP across GPUs when more than one is present. Then, where vLLM is installed, the
# server row and the one-step-off row (bench_async.py: the MAGRPO demo sampling from two `vllm serve` processes on
# the same GPU (the weights by file: NCCL needs the servers on other GPUs than the trainer), max_staleness 0
# against 1, seconds per update; ≤ 5 more minutes).
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]        # default benchmarks/results
set -euo pipefail
RESULTS=${1:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false \
       PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, lightning, transformers, peft; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
timeout 450 "$PY" benchmarks/gpu_check.py --json "$RESULTS/gpu_check.json"
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -gt 1 ]; then
  timeout 120 "$PY" benchmarks/bench_scaling.py --device cuda --model tiny-5m --processes 1,2 --repeats 1 \
    --json "$RESULTS/gpu_scaling.json"
fi
if "$PY" -c "import vllm" 2>/dev/null; then
  timeout 300 "$PY" benchmarks/bench_async.py --device cuda --configs configs/magrpo.yaml --steps 6 --repeats 1 \
    --json "$RESULTS/gpu_async.json" || echo "the server / one-step-off rows did not finish ($?)"
fi
