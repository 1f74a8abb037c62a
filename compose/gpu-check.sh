#!/usr/bin/env bash
# What compose/smoke.sh checks of the GPU variant on a machine without a GPU (or without a registry):
#   1. `docker compose -f compose/compose.yaml --profile gpu config`: Compose's own validation of the GPU
#      variant (device reservations, shared namespaces), and that it has the services gateway, verifier, drafter;
#   2. compose/Dockerfile.gpu builds over a base that already has torch (the "torch" stage of
#      compose/Dockerfile.cpu stands in for pytorch/pytorch), keeps that base's torch, installs the package and
#      its demo model, runs as uid 10001, and its `specdec verifier` / `specdec drafter` start (--help).
# Not checked here: the CUDA base image, the NVIDIA runtime, the GPU reservation and CUDA IPC between containers.
#   bash compose/gpu-check.sh BASE_IMAGE TORCH_FROM        (as compose/smoke.sh calls it)
set -euo pipefail
[ $# = 2 ] || { echo "usage: $0 BASE_IMAGE TORCH_FROM (see compose/Dockerfile.cpu)" >&2; exit 2; }
base=$1 torch_from=$2
cd "$(dirname "$0")/.."
die() { echo "gpu-check: error: $*" >&2; exit 1; }

services=$(docker compose -f compose/compose.yaml --profile gpu config --services | sort | tr '\n' ' ')
[ "$services" = "drafter gateway verifier " ] || die "the GPU variant's services are '$services'"
docker compose -f compose/compose.yaml --profile gpu config --format json | python3 -c '
import json, sys
services = json.load(sys.stdin)["services"]
for name in ("verifier", "drafter"):
    devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
    assert [d["capabilities"] for d in devices] == [["gpu"]], (name, devices)
    assert "--device" in services[name]["command"] and "cuda" in services[name]["command"], name
assert services["drafter"]["ipc"] == services["drafter"]["pid"] == "service:verifier"
print("gpu-check: compose accepts the GPU variant: verifier and drafter reserve one GPU, the drafter joins "
      "the ipc and pid namespaces of the verifier")'

build() {   # build TAG DOCKERFILE TARGET BASE [ARG=VALUE]: one image through compose (BuildKit, no buildx needed)
  local args="BASE_IMAGE: \"$4\""
  [ -n "${5:-}" ] && args="$args, ${5%%=*}: \"${5#*=}\""
  docker compose -p specdec-gpu-check -f - --progress quiet build <<YAML
services:
  image:
    image: $1
    build: {context: ., dockerfile: $2, ${3:+target: $3,} args: {$args}}
YAML
}
build specdec-torch:check compose/Dockerfile.cpu torch "$base" "TORCH_FROM=$torch_from"
build specdec:gpu-check compose/Dockerfile.gpu "" specdec-torch:check
before=$(docker run --rm specdec-torch:check python -W ignore -c 'import torch; print(torch.__version__)')
after=$(docker run --rm specdec:gpu-check python -c 'import torch; print(torch.__version__)')
[ "$before" = "$after" ] || die "compose/Dockerfile.gpu replaced the base's torch $before by $after"
[ "$(docker run --rm specdec:gpu-check id -u)" = 10001 ] || die "the GPU image does not run as uid 10001"
docker run --rm specdec:gpu-check specdec verifier --help > /dev/null
docker run --rm specdec:gpu-check specdec drafter --help > /dev/null
echo "gpu-check: compose/Dockerfile.gpu built over torch $before (kept), uid 10001, verifier and drafter CLIs start;" \
     "$(docker image inspect --format '{{.Size}}' specdec:gpu-check | awk '{printf "%.0f MB", $1 / 1e6}')"
