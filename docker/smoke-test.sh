#!/usr/bin/env bash
# Run built images the way a deployment does, and check they serve: a gateway image in front of an engine
# image, then `kvgate up` in the engine image.
#
#   docker/smoke-test.sh [GATEWAY_IMAGE] [ENGINE_IMAGE]
#       (defaults: localhost/kvgate:VERSION-gateway and localhost/kvgate:VERSION-cpu)
#
# 1. `--version`, `router --help`, and `registry validate` of examples/fleet mounted read-only;
# 2. an engine (builtin:tiny-llama, on CPU) and a gateway whose static registry names it, both with host
#    networking on ports 18000/19000/18080: /health, a completion and a chat completion through the gateway,
#    an unknown model's 404; then SIGTERM (`podman stop`) to each, which must drain and exit 0;
# 3. `kvgate up` in the engine image with a local pool on port 18081: a replica (a child process) becomes
#    ready and serves a completion; SIGTERM must stop it and exit 0.
# Uses podman (or CONTAINER=docker); PODMAN_OPTS / PODMAN_RUN_OPTS as docker/build-image.sh printed them.
# Writes only under a fresh temporary folder; removes its containers on exit.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/kvgate/__init__.py")
gateway_image=${1:-localhost/kvgate:$version-gateway}
engine_image=${2:-localhost/kvgate:$version-cpu}
read -r -a container <<<"${CONTAINER:-podman} ${PODMAN_OPTS:-}"
read -r -a run_opts <<<"${PODMAN_RUN_OPTS:-}"
work=$(mktemp -d)
containers=()

die() { echo "smoke-test: FAILED: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }
cleanup() {
    for c in "${containers[@]}"; do "${container[@]}" rm -f "$c" >/dev/null 2>&1 || true; done
    rm -rf "$work"
}
trap cleanup EXIT
run() { "${container[@]}" run --rm "${run_opts[@]}" "$@"; }
start() {  # start NAME IMAGE ARGS...: a detached container on the host's network
    local name=$1; shift
    containers+=("$name")
    "${container[@]}" run -d --name "$name" --network host "${run_opts[@]}" "$@" >/dev/null
}
wait_for() {  # wait_for SECONDS URL [TEXT]: until URL answers 2xx (and its body holds TEXT)
    local deadline=$((SECONDS + $1)) body
    while [ $SECONDS -lt $deadline ]; do
        if body=$(curl -fs "$2" 2>/dev/null) && [[ $body == *"${3:-}"* ]]; then echo "$body"; return 0; fi
        sleep 0.25
    done
    return 1
}
stop_clean() {  # stop NAME: SIGTERM, then the exit code must be 0
    local started=$SECONDS code
    "${container[@]}" stop -t 30 "$1" >/dev/null
    code=$("${container[@]}" inspect -f '{{.State.ExitCode}}' "$1")
    [ "$code" = 0 ] || die "$1 exited $code after SIGTERM; its log: $("${container[@]}" logs "$1" 2>&1 | tail -5)"
    ok "$1 drained and exited 0 after SIGTERM ($((SECONDS - started)) s)"
}

# 1.
[ "$(run "$gateway_image" --version)" = "kvgate $version" ] || die "$gateway_image --version"
[ "$(run "$engine_image" --version)" = "kvgate $version" ] || die "$engine_image --version"
run "$gateway_image" router --help | grep -q -- "--registry" || die "router --help"
run -v "$repo/examples/fleet:/etc/kvgate/registry:ro" "$gateway_image" registry validate /etc/kvgate/registry \
    || die "registry validate examples/fleet"
[ "$(run --entrypoint id "$gateway_image" -u)" = 10001 ] || die "the image does not run as uid 10001"
ok "--version, router --help, registry validate, uid 10001"

# 2.
mkdir -p "$work/registry" "$work/up-registry"
cat >"$work/registry/models.yaml" <<'YAML'
apiVersion: kvgate/v1
kind: Model
metadata: {name: tiny-llama}
spec:
  source: builtin:tiny-llama
  routing: {static_replicas: [{url: 'http://127.0.0.1:18000', backend: kvgate, grpc_target: '127.0.0.1:19000'}]}
YAML
chmod -R a+rX "$work"
start kvgate-smoke-engine "$engine_image" engine --model builtin:tiny-llama --served-model-name tiny-llama \
    --host 127.0.0.1 --port 18000 --grpc-port 19000 --device cpu
wait_for 120 http://127.0.0.1:18000/health >/dev/null || die "the engine never answered /health"
start kvgate-smoke-gateway -v "$work/registry:/etc/kvgate/registry:ro" "$gateway_image" router \
    --registry /etc/kvgate/registry --host 127.0.0.1 --port 18080
wait_for 60 http://127.0.0.1:18080/health '"tiny-llama": 1' >/dev/null || die "the gateway never saw the engine ready"
ok "gateway /health lists the engine as ready"
completion=$(curl -fs http://127.0.0.1:18080/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "tiny-llama", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}')
[[ $completion == *'"completion_tokens":8'* ]] || die "completion through the gateway: $completion"
chat=$(curl -fs -D "$work/headers" http://127.0.0.1:18080/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}')
if [[ $chat != *'"chat.completion"'* ]] || ! grep -qi '^x-kvgate-replica: tiny-llama-static-0' "$work/headers"; then
    die "chat completion through the gateway: $chat"
fi
status=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:18080/v1/completions \
    -H 'Content-Type: application/json' -d '{"model": "nope", "prompt": "x"}')
[ "$status" = 404 ] || die "an unknown model got $status, not 404"
ok "completion and chat completion served by the engine through the gateway; unknown model 404"
stop_clean kvgate-smoke-gateway
stop_clean kvgate-smoke-engine

# 3.
cat >"$work/up-registry/models.yaml" <<'YAML'
apiVersion: kvgate/v1
kind: Model
metadata: {name: tiny-llama}
spec:
  source: builtin:tiny-llama
  engine: {max_model_len_tokens: 512, kv_cache_bytes: 32MiB}
  scaling: {min_replicas: 1, max_replicas: 1}
---
apiVersion: kvgate/v1
kind: Pool
metadata: {name: local}
spec:
  provider: local
  max_nodes: 1
  node_boot_s: 0
  offers: [{instance_type: local-slot, gpu_kind: cpu, gpu_count: 0, price_usd_per_hour: 0}]
  local: {host: 127.0.0.1, work_dir: /home/kvgate/work}
YAML
chmod -R a+rX "$work"
start kvgate-smoke-up -v "$work/up-registry:/etc/kvgate/registry:ro" "$engine_image" up \
    --registry /etc/kvgate/registry --host 127.0.0.1 --port 18081
wait_for 180 http://127.0.0.1:18081/health '"tiny-llama": 1' >/dev/null || die "kvgate up: no ready replica"
completion=$(curl -fs http://127.0.0.1:18081/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, "temperature": 0}')
[[ $completion == *'"completion_tokens":4'* ]] || die "kvgate up completion: $completion"
ok "kvgate up: a replica child process became ready and served a completion"
stop_clean kvgate-smoke-up
echo "smoke-test: all passed"
