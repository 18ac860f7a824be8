#!/usr/bin/env bash
# A second virtual environment with vllm-omni, for the vllm-omni CPU tests (docs/vllm_omni.md, "Install").
#
# vllm and vllm-omni are GPU packages: installed with their dependency trees they pull CUDA builds of torch,
# torchvision, torchaudio, flashinfer and more. On a CPU host we install both with --no-deps and add only what
# their diffusion registry, loader, data classes, model runner, worker and engine modules import. The pins are the
# combination that installs next to verl 0.9.x (transformers < 5.11): vllm-omni 0.28.0 (transformers >= 5.10.1,
# diffusers == 0.40.0) on vllm 0.28.0 (torch == 2.13.0). A separate environment, so that vllm's presence (verl
# checks for it) and diffusers 0.40 never change the main test suite.
#
#   bash scripts/setup_vllm_omni_cpu.sh            # creates .venv-vllm-omni (VENV=... to choose)
#
# vllm-omni 0.30 (docs/vllm_omni.md, "Versions": measured, not the default): its diffusion worker module does not
# import on CPU (it loads transformers' Qwen2-VL image processor, which needs torchvision), and it requires
# transformers >= 5.13 where verl 0.9.x requires < 5.11, so TRANSFORMERS_OVERRIDE installs that one --no-deps:
#   VENV=.venv-vllm-omni-030 VLLM_OMNI_VERSION=0.30.0 VLLM_VERSION=0.30.0 TRANSFORMERS_OVERRIDE=transformers==5.14.1 \
#     bash scripts/setup_vllm_omni_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE   # the import check below caches the byte-code of what the tests import
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-vllm-omni}"
PY="$VENV/bin/python"
# --no-compile: modules are byte-compiled when first imported (the Makefile drops PYTHONDONTWRITEBYTECODE for that)
PIP="$PY -m pip install -q --no-compile"
# Overridable to try another release (docs/vllm_omni.md, "Versions"); the defaults are the pinned combination.
VLLM_OMNI_VERSION="${VLLM_OMNI_VERSION:-0.28.0}"
VLLM_VERSION="${VLLM_VERSION:-0.28.0}"
TRANSFORMERS_OVERRIDE="${TRANSFORMERS_OVERRIDE:-}"
PINS="$(mktemp)"
trap 'rm -f "$PINS"' EXIT
printf '%s\n' "torch==2.13.0" "transformers>=5.10.1,<5.11" "diffusers==0.40.0" "accelerate==1.12.0" > "$PINS"

"$PYTHON" -m venv "$VENV"
$PIP --upgrade pip
$PIP "torch==2.13.0" uv                     # CPU torch first and alone, as in the Makefile
# The rest with uv, as in the Makefile (parallel downloads), pip when uv fails; no uv cache when pip keeps none.
if [ -n "${PIP_NO_CACHE_DIR:-}" ]; then export UV_NO_CACHE=1; fi
install() { "$VENV/bin/uv" pip install -q --python "$PY" "$@" || $PIP "$@"; }
install -c "$PINS" -e ".[test]"
install --no-deps "vllm==$VLLM_VERSION" "vllm-omni==$VLLM_OMNI_VERSION"
# Imported at module level by vllm / vllm-omni's diffusion stack; wheels with no CUDA code.
install -c "$PINS" "aenum==3.1.16" "cbor2" "openai-harmony" "openai" "pybase64" "uvloop" "py-cpuinfo" "tiktoken" \
    "loguru" "prettytable" "einops" "janus" "accelerate==1.12.0" "msgspec" "pyzmq" "blake3" "gguf" \
    "partial-json-parser" "lark==1.2.2"
# Their own dependencies are GPU builds (triton, CUDA toolkits): only the Python packages.
install --no-deps "xgrammar<1.0.0,>=0.2.1" "llguidance<1.8.0,>=1.7.0" "cache-dit==1.5.0" "outlines_core==0.2.14" \
    "apache-tvm-ffi==0.1.11"
# CUDA-linked wheels that a dependency (verl[verl-core]) brings and that fail to load next to CPU torch; vllm
# guards both imports (ImportError), so without them its modules load.
"$PY" -m pip uninstall -q -y torchvision torchcodec 2>/dev/null || true
if [ -n "$TRANSFORMERS_OVERRIDE" ]; then install --no-deps "$TRANSFORMERS_OVERRIDE"; fi
# What the CPU tests need: registry, loader, data classes, request batch, model runner, engine. The worker layer and
# AsyncOmni import with 0.28; where they do not (0.30), the tests that need them skip with the reason.
"$PY" - <<'PY'
import importlib.metadata as md
import vllm_omni.diffusion.diffusion_engine, vllm_omni.diffusion.model_loader.diffusers_loader  # noqa: F401
import vllm_omni.diffusion.registry, vllm_omni.diffusion.worker.request_batch  # noqa: F401
import vllm_omni.diffusion.worker.diffusion_model_runner  # noqa: F401
try:
    import vllm_omni.diffusion.worker.diffusion_worker, vllm_omni.entrypoints.async_omni  # noqa: F401
    worker = "worker layer and AsyncOmni import"
except ImportError as err:
    worker = f"worker layer does not import here ({err}): its tests skip"
print("vllm-omni CPU environment:", ", ".join(f"{p} {md.version(p)}" for p in
      ("vllm-omni", "vllm", "verl", "torch", "transformers", "diffusers")) + ";", worker)
PY
touch "$VENV/.installed"
