# The two commands of the README. Each bootstraps .venv when it is missing or
# when pyproject.toml changed, then runs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTHON := $(VENV)/bin/python
# torch is pinned here: a loose range in a fresh venv would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench clean venv

$(STAMP): pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet "$(TORCH_PIN)" -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/handoff demo

test: $(STAMP)
	$(PYTHON) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
