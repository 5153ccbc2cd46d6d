#!/usr/bin/env bash
# Runs the `openai` and `anthropic` Python client tests (chat, streaming, structured output,
# tools) against a fresh `target-host serve`.
#
#   tests/python/run.sh [pytest args...]
#
# Creates the venv .venv-srv (openai, anthropic, pytest) when absent, starts the server on a
# free port with the real SmolLM2 model, runs pytest, and stops the server. Needs a built
# target-host (cargo build -p target-host); set SPECULA_BIN to use another binary.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv="${SPECULA_VENV:-$root/.venv-srv}"
bin="${SPECULA_BIN:-$root/target/debug/target-host}"
[ -x "$bin" ] || { echo "run.sh: $bin is not built (cargo build -p target-host)" >&2; exit 2; }

if [ ! -x "$venv/bin/pytest" ] || ! "$venv/bin/python" -c "import openai, anthropic" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai anthropic pytest
fi

model=$("$root/scripts/fetch-model" smollm2-135m)
log=$(mktemp)
"$bin" serve --model "$model" --port 0 2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -f "$log"' EXIT

addr=""
for _ in $(seq 1 600); do
  addr=$(sed -n 's/^listening on \(http:\/\/[^ ]*\).*/\1/p' "$log" | head -n1)
  [ -n "$addr" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$addr" ] || { echo "run.sh: the server did not start" >&2; cat "$log" >&2; exit 1; }

SPECULA_BASE_URL="$addr" SPECULA_BIN="$bin" SPECULA_MODEL="$model" \
  "$venv/bin/pytest" -q "$root/tests/python" "$@"
