#!/usr/bin/env bash
# Issue 12's device check. Two steps:
#   bench/gpu_check.sh prepare          # here (network): wheels + tokenizer into wheels/gpu/ (git-ignored, < 64 MiB)
#   bench/gpu_check.sh [ARGS...]        # on the GPU host (no network): install them into a local dir, run the
#                                       # check (bench/gpu_check.py ARGS, default --device cuda) within 5 minutes
# The GPU host has torch (CUDA), transformers, httpx, numpy, pyyaml, prometheus-client (docs: FACTS); the
# packages below are the server stack it lacks, pinned to the versions this repository is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=wheels/gpu
PKGS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 typing-extensions==4.16.0 click==8.5.1
h11==0.16.0 pyzmq==27.3.0 opentelemetry-api importlib-metadata zipp"

if [[ "${1:-}" == "prepare" ]]; then
    mkdir -p "$WHEELS"
    PY=${PYTHON:-.venv/bin/python}
    # shellcheck disable=SC2086
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" $PKGS
    # the tokenizer of the random-weight models (the SmolLM2 GGUF itself is too big to travel)
    "$PY" -c "from engine.tokenizer import Tokenizer; Tokenizer.from_model_path(__import__('engine.model_files', fromlist=['x']).resolve_model_path('smollm2')).hf.save_pretrained('$WHEELS/tokenizer')"
    du -sh "$WHEELS"
    exit 0
fi

PY=${PYTHON:-python3}
SITE=$PWD/.gpu_site
if [[ ! -d "$SITE" ]]; then
    "$PY" -m pip install --quiet --no-deps --no-index --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
ARGS=("$@")
[[ ${#ARGS[@]} -eq 0 ]] && ARGS=(--device cuda)
exec timeout 300 "$PY" bench/gpu_check.py --tokenizer-dir "$WHEELS/tokenizer" --work "${GPU_CHECK_WORK:-/tmp/gpu_check}" "${ARGS[@]}"
