#!/usr/bin/env bash
# GPU smoke test: the sd35_ocr_flowgrpo settings (LoRA r32/a64, group 24, 10 steps, noise 0.7, bf16, FSDP2,
# EMA, KL beta 0.04) on the tiny SD3 architecture at 512 px, a few steps on one GPU. Prints images/s and peak
# GPU memory per step. Then the vllm-omni engine checks (docs/vllm_omni.md) when vllm-omni is installed
# (pip install -e '.[vllm-omni]'). Run from the repository root:  bash scripts/gpu_smoke.sh [extra hydra overrides]
set -euo pipefail
ROOT="${VERL_DIFFUSION_RUN_ROOT:-/tmp/verl_diffusion_gpu_smoke}"
export VERL_DIFFUSION_RUN_ROOT="$ROOT"
python -m verl_diffusion.main_flowgrpo --config-name sd35_ocr_flowgrpo \
  'actor_rollout_ref.model.tiny={seed: 0, sample_size: 128}' \
  'data.train_files=[pkg://verl_diffusion/data/tiny_train_prompts.txt]' \
  'data.val_files=[pkg://verl_diffusion/data/tiny_val_prompts.txt]' \
  data.train_batch_size=2 \
  '~reward.components.ocr' '+reward.components.jpeg_compressibility=1.0' \
  trainer.n_gpus_per_node=1 trainer.total_training_steps=4 trainer.test_freq=4 trainer.val_num_images=4 \
  trainer.save_freq=-1 'trainer.logger=[]' \
  trainer.default_local_dir="$ROOT/sd35_ocr_flowgrpo/checkpoints" trainer.run_dir="$ROOT/sd35_ocr_flowgrpo" "$@"
python - "$ROOT/sd35_ocr_flowgrpo/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"step {r['step']}: {r.get('perf/throughput_images_per_s', float('nan')):.2f} images/s, "
          f"peak GPU memory {r.get('perf/max_memory_allocated_gb', float('nan')):.2f} GiB allocated / "
          f"{r.get('perf/max_memory_reserved_gb', float('nan')):.2f} GiB reserved, reward {r['reward/mean']:.4f}")
PY
# vllm-omni's diffusion engine with our pipelines: generate, LoRA add/remove, collective_rpc weights, sleep/wake.
if python -c "import vllm_omni" 2>/dev/null; then
  python -m pytest -q -s -p no:cacheprovider tests/rollout/vllm_omni_rollout
else
  echo "vllm-omni not installed: pip install -e '.[vllm-omni]' to run tests/rollout/vllm_omni_rollout/*_gpu.py"
fi
