#!/usr/bin/env bash
# Installs what the tests need on top of scripts/install.sh (run that first),
# as root on Debian/Ubuntu: etcd (the tests start real etcd members), haproxy
# (tests/test_haproxy*.py run compose/haproxy.cfg), Debian's Chromium
# (tests/test_cluster_page.py drives it through Playwright, never Playwright's
# own browser downloads), promtool (the alert rules' check) and the `test`
# extra (pytest, openai, playwright, ruff, mypy...) into .venv. Idempotent:
# a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv/bin/python ] || { echo "install-test: no .venv: run scripts/install.sh first" >&2; exit 1; }

need_apt=()
command -v etcd >/dev/null || need_apt+=(etcd-server)
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null || need_apt+=(haproxy)
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
# promtool (Debian's prometheus package): tests/test_deploy_metrics.py checks
# deploy/prometheus/alerts.yml with it.
command -v promtool >/dev/null || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi
.venv/bin/python -m pip install -q -e '.[test]'
echo "test tools installed in $(pwd)/.venv"
