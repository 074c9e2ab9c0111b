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
.venv/bin/python -m pytest -q --durations=10 "$@"
