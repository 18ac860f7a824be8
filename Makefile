# verl-diffusion: the two commands of the README.
#   make run    set up from scratch (venv, CPU torch 2.13.0 first, the package) and train the tiny default
#   make test   set up from scratch and run the test suite
# PYTHON picks the interpreter that creates the venv; VENV its folder.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: setup run test check bench clean

setup: $(VENV)/.installed

# Torch goes in first and alone: a bare `torch` requirement resolved later would pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m verl_diffusion.check
	touch $@

run: setup
	$(PY) -m verl_diffusion.main_flowgrpo $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests $(ARGS)

check: setup
	$(PY) -m verl_diffusion.check

bench: setup
	$(PY) benchmarks/estimator_variance.py
	$(PY) benchmarks/loss_kernels.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
