#!/usr/bin/env bash
# Lint, type-check, check the import rules, then the whole test suite (real
# etcd, gateways, agents, engines). Expects scripts/install.sh and scripts/install-test.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check app tests bench
.venv/bin/python -m mypy
# The import rules in pyproject.toml ([tool.importlinter];
# docs/architecture.md, "Folders: the packages").
.venv/bin/lint-imports
# The tests run the router that ships, compiled (app/compiled.py): a copy
# older than the router's source is built again first (about 2 minutes).
if [ "${LLMGW_COMPILE:-1}" != 0 ] && [ "${LLMGW_ROUTER_COMPILED:-on}" != off ] \
    && [[ $(.venv/bin/python -m app.compiled state) != compiled* ]]; then
  echo "compiling the router with mypyc (app/compiled.py)..."
  .venv/bin/python -m app.compiled build
fi
.venv/bin/python -m pytest -q --durations=10 "$@"
