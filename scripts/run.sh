#!/usr/bin/env bash
# The main job: set up from nothing, then start a local cluster on the default
# model (router + prefill + decode) and keep it serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve launch "$@"
