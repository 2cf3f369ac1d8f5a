#!/usr/bin/env bash
# api-fuzz.sh: fuzz the coordinator's REST API against its own OpenAPI document with
# schemathesis (https://schemathesis.readthedocs.io). Not part of CI; run it by hand after
# changing crates/coordinator/src/api.rs or the bodies in crates/protocol/src/api.rs.
#
# What it does, all on 127.0.0.1:
#   1. builds `gpuci` (debug) unless GPUCI_BIN names a binary;
#   2. starts `gpuci server` on a free port with a temp data dir;
#   3. starts an agent with simulated GPUs, runs one short pipeline to the end (so there are
#      real jobs, logs, agents and GPUs to answer with), then stops the agent so that no
#      pipeline the fuzzer submits is ever executed;
#   4. runs schemathesis on /api/v1/openapi.json, with the API token for the operations that
#      need it and the registration token for agent registration (matched to the document's
#      security schemes by a generated schemathesis.toml), and the checks
#      not_a_server_error, status_code_conformance, content_type_conformance and
#      response_schema_conformance, a fixed seed and a fixed number of examples;
#   5. stops the server and removes the temp dirs.
# `/api/v1/pipelines/{id}/watch` is left out: it streams until the pipeline ends, and fuzzed
# pipelines never end (no agent runs them). The Rust test crates/cli/tests/openapi.rs covers it.
#
# Usage:  scripts/api-fuzz.sh [extra schemathesis args...]
# Env:    MAX_EXAMPLES (default 50), SEED (default 1), GPUCI_BIN, CARGO_TARGET_DIR,
#         SCHEMATHESIS (default `schemathesis`; install with `pip install schemathesis`).
# Exit status: schemathesis's (0 when every check passed).
set -euo pipefail

MAX_EXAMPLES="${MAX_EXAMPLES:-50}"
SEED="${SEED:-1}"
SCHEMATHESIS="${SCHEMATHESIS:-schemathesis}"
root="$(cd "$(dirname "$0")/.." && pwd)"

if [[ -z "${GPUCI_BIN:-}" ]]; then
    (cd "$root" && cargo build -q -p gpuci)
    GPUCI_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/gpuci"
fi
command -v "$SCHEMATHESIS" >/dev/null || { echo "api-fuzz: $SCHEMATHESIS not found (pip install schemathesis)" >&2; exit 2; }

work="$(mktemp -d -t gpuci-api-fuzz.XXXXXX)"
server_pid=""
agent_pid=""
cleanup() {
    [[ -n "$agent_pid" ]] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null || true
    [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# 2. The server prints its URL on the first line of stdout.
mkfifo "$work/url"
"$GPUCI_BIN" server --listen 127.0.0.1:0 --data-dir "$work/server" >"$work/url" 2>"$work/server.log" &
server_pid=$!
read -r url <"$work/url"
[[ "$url" == http://127.0.0.1:* ]] || { echo "api-fuzz: server printed '$url'" >&2; exit 1; }
token="$(cat "$work/server/api-token")"
auth=(-H "Authorization: Bearer $token")
echo "api-fuzz: server at $url (log: kept in $work/server.log until exit)"

# 3. Real data: one agent, one finished pipeline.
"$GPUCI_BIN" agent --server "$url" --registration-token-file "$work/server/registration-token" \
    --data-dir "$work/agent" --name fuzz-agent --simulate-gpus 2xH100-80GB --isolation none \
    >/dev/null 2>"$work/agent.log" &
agent_pid=$!
pipeline='{"file_name":"fuzz.yml","source":"steps:\n  - key: hello\n    command: echo hello\n  - key: bye\n    depends_on: [hello]\n    command: echo bye; exit 3\n"}'
pid="$(curl -sf "${auth[@]}" -H 'Content-Type: application/json' -d "$pipeline" "$url/api/v1/pipelines" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
for _ in $(seq 300); do
    state="$(curl -sf "${auth[@]}" "$url/api/v1/pipelines/$pid" | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')"
    [[ "$state" != running ]] && break
    sleep 0.1
done
echo "api-fuzz: seed pipeline $pid ended: $state"
kill "$agent_pid" && wait "$agent_pid" 2>/dev/null || true
agent_pid=""

# 4. Fuzz. Only this server is ever contacted (--url pins the base URL; no redirects).
# Tokens by security scheme (see components.securitySchemes in the document).
cat >"$work/schemathesis.toml" <<'TOML'
[auth.openapi.bearer]
bearer = "${GPUCI_FUZZ_API_TOKEN}"

[auth.openapi.registration_token]
bearer = "${GPUCI_FUZZ_REGISTRATION_TOKEN}"
TOML
export GPUCI_FUZZ_API_TOKEN="$token"
GPUCI_FUZZ_REGISTRATION_TOKEN="$(cat "$work/server/registration-token")"
export GPUCI_FUZZ_REGISTRATION_TOKEN
status=0
cd "$work"
"$SCHEMATHESIS" --no-color --config-file "$work/schemathesis.toml" run "$url/api/v1/openapi.json" \
    --url "$url" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --exclude-path-regex '/watch$' \
    --max-examples "$MAX_EXAMPLES" \
    --seed "$SEED" \
    --max-redirects 0 \
    --request-timeout 10 \
    --workers 1 \
    --generation-database none \
    "$@" || status=$?
if grep -q panicked "$work/server.log"; then
    echo "api-fuzz: the server panicked:" >&2
    grep -A3 panicked "$work/server.log" >&2
    status=1
fi
exit "$status"
