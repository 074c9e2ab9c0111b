#!/usr/bin/env bash
# The benchmarks users run, through llmgw and straight to the engine, on
# SmolLM2-135M: inference-perf and GuideLLM, the two paths interleaved, on the
# quickstart's llama.cpp engine or (--engine vllm) on real vLLM's CPU build
# (scripts/install-test.sh installs it). See bench/README.md.
#
#   bench/serve.sh                      # installs the tools on first run, then ~6 min
#   bench/serve.sh --concurrency 32 --seconds 60 --pairs 2 --tools guidellm
#   bench/serve.sh --engine vllm        # concurrency 1 and 8; ~25 min on 2 cores
#
# Each tool lives in a venv of its own under $LLMGW_BENCH_CACHE
# (~/.cache/llmgw/bench-serve), never the project's. Its results go to
# $CACHE/RESULTS.md (LLMGW_BENCH_RESULTS; `--results bench/RESULTS.md` to
# update the repository's record on purpose). Last line:
# serve: engine= concurrency= tool= throughput_ratio= ttft_added_p50_ms= ...
# (one line per concurrency).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${LLMGW_BENCH_CACHE:-$HOME/.cache/llmgw/bench-serve}"
RESULTS="${LLMGW_BENCH_RESULTS:-$CACHE/RESULTS.md}"
mkdir -p "$CACHE"

say() { echo "serve.sh: $*" >&2; }

# The first Python >= 3.12 that runs (inference-perf 0.7 needs it): a name
# on PATH may be a version manager's shim for a version not selected here,
# which exits 127 (pyenv's "python3.12: command not found").
python312() {
  local c
  for c in python3.12 python3.13 python3.14 python3; do
    c=$(command -v "$c") || continue
    "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 \
      && { echo "$c"; return 0; }
  done
  return 1
}
PY312="${LLMGW_BENCH_PY312:-$(python312 || true)}"
PY="${LLMGW_BENCH_PY:-.venv/bin/python}"
[ -x "$PY" ] || { say "$PY not found: run scripts/install.sh first (or set LLMGW_BENCH_PY)"; exit 1; }
# The arguments and the engine's install checked before minutes of installing.
"$PY" bench/serve.py --cache "$CACHE" --check "$@"

# install VENV PACKAGE...: a venv of its own, once (a marker says it finished).
install() {
  local venv="$CACHE/$1"; shift
  [ -f "$venv/.installed" ] && return 0
  [ -n "$PY312" ] && [ -x "$PY312" ] \
    || { say "no Python 3.12 or later that runs found on PATH (set LLMGW_BENCH_PY312)"; exit 1; }
  say "installing $* into $venv (once)"
  rm -rf "$venv"
  "$PY312" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$@" >"$venv.install.log" 2>&1 \
    || { say "pip failed, see $venv.install.log"; tail -n 5 "$venv.install.log" >&2; exit 1; }
}

install inference-perf 'inference-perf==0.7.0'
touch "$CACHE/inference-perf/.installed"
# GuideLLM 0.8.1 loads its data through torch's DataLoader: torch is needed.
# The CPU build is enough (LLMGW_BENCH_TORCH, e.g. 'torch==2.13.0+cpu' where a
# CPU wheel is at hand; plain 'torch' from PyPI brings CUDA's libraries, GBs).
# The venv's Python: LLMGW_BENCH_PY_GUIDELLM (any 3.10+ with that torch wheel).
PY312_SAVED="$PY312"
PY312="${LLMGW_BENCH_PY_GUIDELLM:-$PY312}"
install guidellm "${LLMGW_BENCH_TORCH:-torch}" 'guidellm==0.8.1'
touch "$CACHE/guidellm/.installed"
PY312="$PY312_SAVED"

# A --results among the arguments comes later, so it wins.
exec "$PY" bench/serve.py --cache "$CACHE" --results "$RESULTS" "$@"
