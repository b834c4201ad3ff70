#!/usr/bin/env bash
# The main job: set up from nothing, then start a local cluster on the default
# model (router + prefill + decode) and keep it serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if .venv/bin/python -c "import pdserve.engine.cluster" 2>/dev/null; then
  exec .venv/bin/pdserve launch "$@"
elif .venv/bin/python -c "import pdserve.engine.frontend.http_server" 2>/dev/null; then
  exec .venv/bin/pdserve serve "$@"
else
  exec .venv/bin/python scripts/demo_generate.py "$@"
fi
