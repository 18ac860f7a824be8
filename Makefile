# verl-diffusion: the two commands of the README.
#   make run    set up from scratch (venv, CPU torch 2.13.0 first, the package) and train the tiny default
#   make test   set up from scratch and run the test suite
#   make test-vllm-omni   the vllm-omni CPU tests in their own venv (scripts/setup_vllm_omni_cpu.sh)
# PYTHON picks the interpreter that creates the venv; VENV its folder.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
VO_VENV ?= .venv-vllm-omni
TEST_WORKERS ?= 2

.PHONY: setup run test check bench clean setup-vllm-omni test-vllm-omni

# Byte-code is compiled on first import and cached, not by pip for every module of every package at install time
# (--no-compile below: half of a cold install's time, mostly modules no process imports). Hence the variable that
# some images set (PYTHONDONTWRITEBYTECODE=1) is dropped for everything make starts: with it, each process
# (pytest, Ray workers, subprocesses) would compile torch, verl and this package anew.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := $(PY) -m pip install -q --no-compile
# The package and its ~100 dependencies go in with uv (parallel downloads: 15 s where pip takes 75 s, the same
# versions), pip when uv fails. uv keeps no cache when pip is told to keep none.
UV_INSTALL := $(VENV)/bin/uv pip install -q --python $(PY)
ifneq ($(PIP_NO_CACHE_DIR),)
export UV_NO_CACHE := 1
endif

setup: $(VENV)/.installed

# Torch goes in first and alone (pip: it reads pip's configuration, where a local CPU wheel may be): a bare `torch`
# requirement resolved later would pull a CUDA build; the later install names the same torch, so it stays.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) "$(TORCH)" uv
	$(UV_INSTALL) "$(TORCH)" -e ".[test]" || $(PIP_INSTALL) -e ".[test]"
	$(PY) -m verl_diffusion.check
	touch $@

run: setup
	$(PY) -m verl_diffusion.main_flowgrpo $(ARGS)

# Two xdist workers (TEST_WORKERS=0: one process): the e2e trainings on one, the unit modules around them (tests/conftest.py).
test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadgroup tests $(ARGS)

# vllm and vllm-omni go into a second venv (--no-deps on CPU; docs/vllm_omni.md): the main suite never sees them.
setup-vllm-omni: $(VO_VENV)/.installed

$(VO_VENV)/.installed: pyproject.toml scripts/setup_vllm_omni_cpu.sh
	VENV=$(VO_VENV) PYTHON=$(PYTHON) bash scripts/setup_vllm_omni_cpu.sh

test-vllm-omni: setup-vllm-omni
	$(VO_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/rollout/vllm_omni_rollout $(ARGS)

check: setup
	$(PY) -m verl_diffusion.check

bench: setup
	$(PY) benchmarks/estimator_variance.py
	$(PY) benchmarks/loss_kernels.py

clean:
	rm -rf $(VENV) $(VO_VENV) outputs .pytest_cache
