#!/bin/bash
# Entry point of the compose `vllm` service (profile gpu): serve the model, then register
# this replica with rollstream's balancer through the API; unregister on stop. Every
# replica registers its own address, so `--scale vllm=N` gives the balancer N backends.
set -euo pipefail
: "${VLLM_MODEL:?set VLLM_MODEL (a hub name or a folder mounted into the container)}"
: "${VLLM_PORT:=8000}"
: "${VLLM_ARGS:=}"
: "${ROLLSTREAM_API_URL:=http://api:8321}"
: "${ROLLSTREAM_API_TOKEN:?the API token (the same ROLLSTREAM_API_TOKEN the api service has)}"
url="http://$(hostname -i | awk '{print $1}'):${VLLM_PORT}"

api() {  # api METHOD PATH [JSON]
    python3 - "$@" <<'PY'
import json, os, sys, urllib.request
method, path = sys.argv[1], sys.argv[2]
body = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request(os.environ["ROLLSTREAM_API_URL"] + path, data=body, method=method,
                             headers={"Authorization": "Bearer " + os.environ["ROLLSTREAM_API_TOKEN"],
                                      "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=30).read()
PY
}
healthy() {
    python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5)" "$url" 2>/dev/null
}

server=""
registered=0
cleanup() {
    trap - TERM INT EXIT
    # Unregister first, so no new request is routed here while the server stops.
    (( registered )) && api DELETE "/v1/backends?url=${url}" || true
    [[ -n "$server" ]] && kill -TERM "$server" 2>/dev/null && wait "$server" || true
}
trap cleanup TERM INT EXIT

# Dev mode serves /collective_rpc and /reset_prefix_cache, which the trainer's `vllm_reload`
# weight sync calls after it rewrites the served folder (mounted writable at /models).
export VLLM_SERVER_DEV_MODE=1
# shellcheck disable=SC2086  # VLLM_ARGS is a list of words on purpose
python3 -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL" --host 0.0.0.0 --port "$VLLM_PORT" \
    --enable-prefix-caching $VLLM_ARGS &
server=$!
until healthy; do
    kill -0 "$server" 2>/dev/null || { echo "vLLM exited before it served" >&2; exit 1; }
    sleep 5
done
api POST /v1/backends "{\"url\": \"${url}\", \"info\": {\"model\": \"${VLLM_MODEL}\"}}"
registered=1
echo "serving ${VLLM_MODEL} at ${url} (registered with the balancer)"
set +e
wait "$server"
