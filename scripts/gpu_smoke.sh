#!/usr/bin/env bash
# GPU smoke test: each recipe for a few steps on ONE GPU, printing images/s and peak GPU memory per step.
#
#   bash scripts/gpu_smoke.sh                       # every recipe below
#   bash scripts/gpu_smoke.sh qwenimage_ocr_flowgrpo flux1_dev_pickscore_flow_dppo
#   bash scripts/gpu_smoke.sh vllm-omni               # only the vllm-omni engine checks (tiny SD3, Qwen-Image,
#                                                     # FLUX.1, FLUX.2 klein; ~1 engine start per architecture)
#
# The recipe's own loss, sampler, window, steps, grid, guidance, dtype, LoRA and FSDP settings at 512 px, shrunk to
# one GPU (2 prompts × 4 images, 3 steps, validation at step 3). Model weights: set SD35_PATH, QWEN_IMAGE_PATH,
# FLUX2_KLEIN_PATH, FLUX1_DEV_PATH to local diffusers folders to run the real models; unset, the tiny random model of
# the architecture stands in (the code path, not the memory). Rewards that need weights (PickScore, HPSv3) are
# replaced by JPEG compressibility on the packaged prompts; OCR stays (rapidocr on CPU) when ~/data/ocr exists.
# Extra hydra overrides: SMOKE_ARGS="k=v k=v".
# Run from the repository root.
# Then the vllm-omni engine checks (docs/vllm_omni.md) when vllm-omni is installed
# (pip install -e '.[vllm-omni]'): our pipelines served by AsyncOmni, LoRA add/remove, collective_rpc weights,
# sleep / wake, for every architecture.
set -euo pipefail
ROOT="${VERL_DIFFUSION_RUN_ROOT:-/tmp/verl_diffusion_gpu_smoke}"
export VERL_DIFFUSION_RUN_ROOT="$ROOT"
RECIPES=("$@")
if [ "${RECIPES[*]:-}" = "vllm-omni" ]; then
  RECIPES=()
  ONLY_VLLM_OMNI=1
fi
if [ ${#RECIPES[@]} -eq 0 ] && [ -z "${ONLY_VLLM_OMNI:-}" ]; then
  RECIPES=(sd35_ocr_flowgrpo qwenimage_ocr_flowgrpo qwenimage_hpsv3_path_space qwenimage_hpsv3_diffusion_nft
           flux2_klein_ocr_flow_dppo flux1_dev_pickscore_flow_dppo)
fi

for recipe in "${RECIPES[@]+"${RECIPES[@]}"}"; do
  case "$recipe" in
    sd35_*)        arch=sd3;         model="${SD35_PATH:-}" ;;
    qwenimage_*)   arch=qwen_image;  model="${QWEN_IMAGE_PATH:-}" ;;
    flux2_klein_*) arch=flux2_klein; model="${FLUX2_KLEIN_PATH:-}" ;;
    flux1_dev_*)   arch=flux;        model="${FLUX1_DEV_PATH:-}" ;;
    *) echo "unknown recipe $recipe" >&2; exit 2 ;;
  esac
  if [ -n "$model" ]; then
    model_args=("actor_rollout_ref.model.path=$model")
  elif [ "$arch" = sd3 ]; then
    model_args=("actor_rollout_ref.model.path=null" "actor_rollout_ref.model.tiny={architecture: sd3, seed: 0, sample_size: 64}")
  else
    model_args=("actor_rollout_ref.model.path=null" "actor_rollout_ref.model.tiny={architecture: $arch, seed: 0}")
  fi
  # OCR recipes keep their data and reward when ~/data/ocr exists (python data_process/ocr.py); otherwise, and for
  # rewards that need weights, the packaged prompts and JPEG compressibility stand in.
  tiny_data=("data.train_files=[pkg://verl_diffusion/data/tiny_train_prompts.txt]"
             "data.val_files=[pkg://verl_diffusion/data/tiny_val_prompts.txt]"
             "~reward.components" "~reward.options" "+reward.components={jpeg_compressibility: 1.0}" "reward.executor=sync")
  case "$recipe" in
    *_ocr_*) if [ -f "$HOME/data/ocr/train.parquet" ]; then data_args=(); else data_args=("${tiny_data[@]}"); fi ;;
    *) data_args=("${tiny_data[@]}") ;;
  esac
  out="$ROOT/$recipe"
  echo "== $recipe (${model:-tiny $arch}) =="
  # shellcheck disable=SC2086
  python -m verl_diffusion.main_flowgrpo --config-name "$recipe" "${model_args[@]}" "${data_args[@]}" \
    data.train_batch_size=2 actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=1 \
    actor_rollout_ref.rollout.micro_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    trainer.n_gpus_per_node=1 trainer.total_training_steps=3 trainer.test_freq=3 trainer.val_before_train=false \
    trainer.val_num_images=2 trainer.save_freq=-1 'trainer.logger=[]' \
    trainer.default_local_dir="$out/checkpoints" trainer.run_dir="$out" trainer.overwrite=true ${SMOKE_ARGS:-}
  python - "$out/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"step {r['step']}: {r.get('perf/throughput_images_per_s', float('nan')):.2f} images/s, "
          f"peak GPU memory {r.get('perf/max_memory_allocated_gb', float('nan')):.2f} GiB allocated / "
          f"{r.get('perf/max_memory_reserved_gb', float('nan')):.2f} GiB reserved, reward {r['reward/mean']:.4f}, "
          f"|log ratio0| {r.get('actor/first_micro_log_ratio_abs_max', float('nan')):.3g}")
PY
done
# vllm-omni's diffusion engine with our pipelines: generate, LoRA add/remove, collective_rpc weights, sleep/wake.
if python -c "import vllm_omni" 2>/dev/null; then
  python -m pytest -q -s -p no:cacheprovider -rs tests/rollout/vllm_omni_rollout
else
  echo "vllm-omni not installed: pip install -e '.[vllm-omni]' to run tests/rollout/vllm_omni_rollout/*_gpu.py"
fi
