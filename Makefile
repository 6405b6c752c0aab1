# The two commands of the README:  `make quickstart` (the main job) and `make test` (the test suite).
# Both create ./.venv with the CPU build of torch first, so nothing pulls a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH ?= torch==2.13.0

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" -e ".[test]"
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

quickstart: install
	$(BIN)/python trainers/ppo.py

.PHONY: install test quickstart
