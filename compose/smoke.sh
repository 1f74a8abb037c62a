#!/usr/bin/env bash
# The CPU deployment in a real Docker engine, as a user runs it (README, "Deployment with docker compose"):
#   1. installs what it needs, idempotently (compose/engine.sh: Docker Engine, Compose v2, a running dockerd;
#      compose/base-image.sh: a debootstrap'd Debian base image, cached), because no registry is reachable;
#   2. builds the images with `docker compose build` (torch from the host's CPU wheel when there is one);
#   3. `docker compose -f compose/compose.yaml -f compose/compose.cpu.yaml --profile cpu up -d`, waits for health;
#   4. streams greedy completions through the published gateway port, with `specdec generate` and a gRPC client
#      (compose/smoke_client.py), while it swaps the drafter (DRAFTER=ngram ... up -d drafter) and scales it to 0
#      and back: the output must be identical in every phase, and the verifier container the same one;
#   5. checks what it can of the GPU variant (no GPU here), then `down -v`.
# Container logs are printed on any failure; the exit status is non-zero on any failure, including an engine
# that does not start. At the end the build cache is pruned to its 20 GB most recently used (each run adds a few
# GB to it: runs on one machine once filled its disk, and a build then failed with "No space left on device").
#
# Options: --cold         first remove this script's images, base image and build cache (a from-scratch run)
#          --keep-engine  leave dockerd running if this script started it (default: stop it at the end)
#          --no-gpu-check skip building compose/Dockerfile.gpu over the CPU torch stage
# Environment: COMPOSE_PROJECT_NAME (default specdec-smoke), GATEWAY_PORT and HTTP_PORT (default: free ports),
#   TORCH_WHEELS_DIR (default /opt/wheels: where to look for the CPU torch wheel; none: torch from
#   download.pytorch.org), SMOKE_MAX_TOKENS (default 48); those of compose/engine.sh and compose/base-image.sh.
set -euo pipefail

cold=0 keep_engine=0 gpu_check=1
for arg in "$@"; do
  case "$arg" in
    --cold) cold=1 ;;
    --keep-engine) keep_engine=1 ;;
    --no-gpu-check) gpu_check=0 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "smoke: error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-specdec-smoke}
STATE=${SPECDEC_DOCKER_STATE:-/var/tmp/specdec-docker}
WHEELS_DIR=${TORCH_WHEELS_DIR:-/opt/wheels}
MAX_TOKENS=${SMOKE_MAX_TOKENS:-48}
PROMPT="def fibonacci(n):"
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' compose/Dockerfile.cpu)
IMAGES=(specdec:cpu specdec:gateway specdec-torch:check specdec:gpu-check)
START=$(date +%s)
declare -A TIMES=()
linked_wheel=""

say() { printf '\nsmoke [%3ds] %s\n' "$(( $(date +%s) - START ))" "$*"; }
die() { printf 'smoke: error: %b\n' "$*" >&2; exit 1; }
dc() { docker compose -f compose/compose.yaml -f compose/compose.cpu.yaml --profile cpu "$@"; }
timed() {   # timed NAME COMMAND...: runs it, records its seconds under NAME
  local t0=$SECONDS; "${@:2}"; TIMES[$1]=$(( SECONDS - t0 ))
}
cid() { dc ps -q "$1"; }
started_at() { docker inspect --format '{{.State.StartedAt}} restarts={{.RestartCount}}' "$1"; }
mb() { docker image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

client() {  # the gRPC client, from the gateway image, on the host network: through the published port
  docker run --rm --network host -v "$PWD/compose/smoke_client.py:/smoke/smoke_client.py:ro" \
    specdec:gateway python /smoke/smoke_client.py "$@"
}
cli_generate() {  # what the README tells a user to run; stdout is the prompt and the completion
  docker run --rm --network host specdec:gateway \
    specdec generate --address "127.0.0.1:$GATEWAY_PORT" "$PROMPT" --max-tokens "$MAX_TOKENS" --ignore-eos
}

replaced=""   # ids of this script's images before its builds
drop_replaced() {   # the images a rebuild untagged (about 5 GB a run: runs on one machine would fill its disk)
  local id
  for id in $replaced; do
    if [ -z "$(docker image inspect --format '{{join .RepoTags ""}}' "$id" 2>/dev/null)" ]; then
      docker image rm "$id" > /dev/null 2>&1 && echo "smoke: removed the replaced image ${id:7:12}" >&2
    fi
  done
  return 0
}

on_exit() {
  local rc=$?
  set +e
  if [ "$rc" != 0 ] && docker info > /dev/null 2>&1; then
    echo; echo "smoke: FAILED (exit $rc); containers and their logs:" >&2
    dc ps -a >&2
    dc logs --no-color --timestamps --tail 200 >&2
  fi
  docker info > /dev/null 2>&1 && dc down -v --remove-orphans > /dev/null 2>&1
  docker info > /dev/null 2>&1 && drop_replaced
  docker info > /dev/null 2>&1 && docker builder prune -f --keep-storage 20GB > /dev/null 2>&1
  [ -n "$linked_wheel" ] && rm -f "$linked_wheel"
  if [ "$keep_engine" = 0 ] && [ -f "$STATE/dockerd.pid" ]; then
    local pid; pid=$(cat "$STATE/dockerd.pid")
    echo "smoke: stopping the dockerd this run started (pid $pid)" >&2
    kill "$pid" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    rm -f "$STATE/dockerd.pid"
  fi
  exit "$rc"
}
trap on_exit EXIT

say "engine: compose/engine.sh"
timed engine bash compose/engine.sh
docker version --format 'smoke: client {{.Client.Version}}, server {{.Server.Version}} (API {{.Server.APIVersion}})'
if [ "$cold" = 1 ]; then
  say "--cold: removing this script's images, the base images and the build cache"
  dc down -v --remove-orphans > /dev/null 2>&1 || true
  docker image rm -f "${IMAGES[@]}" > /dev/null 2>&1 || true
  docker images --format '{{.Repository}}:{{.Tag}}' specdec-base | xargs -r docker image rm -f > /dev/null
  docker builder prune -af 2> /dev/null | tail -n 1      # the CLI's note on the legacy builder goes to stderr
fi

say "base image: compose/base-image.sh"
t0=$SECONDS; BASE_IMAGE=$(bash compose/base-image.sh); TIMES[base]=$(( SECONDS - t0 ))
wheel=$(find "$WHEELS_DIR" -maxdepth 1 -name "torch-${TORCH_VERSION}[+-]*-cp311-*.whl" 2>/dev/null | sort | head -n 1)
if [ -n "$wheel" ]; then
  TORCH_FROM=wheels
  linked_wheel="compose/wheels/$(basename "$wheel")"
  [ -e "$linked_wheel" ] && linked_wheel=""    # someone else's: keep it
  ln -f "$wheel" compose/wheels/ 2>/dev/null || cp "$wheel" compose/wheels/
  echo "smoke: torch from $wheel (TORCH_FROM=wheels)"
else
  TORCH_FROM=index
  echo "smoke: no torch-${TORCH_VERSION} cp311 wheel in $WHEELS_DIR: torch from download.pytorch.org (TORCH_FROM=index)"
fi

replaced=$(docker image inspect --format '{{.Id}}' "${IMAGES[@]}" 2>/dev/null || true)
say "build: docker compose ... build --build-arg BASE_IMAGE=$BASE_IMAGE --build-arg TORCH_FROM=$TORCH_FROM"
timed build dc --progress plain build --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_FROM=$TORCH_FROM" \
  > "$STATE/build.log" 2>&1 || { tail -n 60 "$STATE/build.log" >&2; die "docker compose build failed (log: $STATE/build.log)"; }
awk '/^#[0-9]+ \[[a-z]+ [a-z0-9-]+ [0-9]+\/[0-9]+\] RUN/ {step[$1] = $2 " " $3 " " $4; run[step[$1]] = 1}
     /^#[0-9]+ CACHED$/ {cached[step[$1]] = 1}
     END {for (s in run) if (s in cached) c++; else r++; printf "smoke: RUN steps (per service): %d run, %d cached\n", r, c}' \
  "$STATE/build.log"
for image in "$BASE_IMAGE" specdec:cpu specdec:gateway; do echo "smoke: image $image: $(mb "$image")"; done
if docker run --rm specdec:gateway python -c "import torch" > /dev/null 2>&1; then
  die "the gateway image can import torch"
fi
echo "smoke: the gateway image has no torch"

say "up: docker compose -f compose/compose.yaml -f compose/compose.cpu.yaml --profile cpu up -d --wait"
dc down -v --remove-orphans > /dev/null 2>&1      # leftovers of an interrupted run
export GATEWAY_PORT=${GATEWAY_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
export HTTP_PORT=${HTTP_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
timed up dc up -d --wait --wait-timeout 600
dc ps --format 'table {{.Service}}\t{{.ID}}\t{{.Status}}\t{{.Ports}}'
verifier=$(cid verifier) gateway=$(cid gateway)
verifier_started=$(started_at "$verifier")

phase() {   # phase NAME DRAFTER_KIND DRAFTS: wait for the drafter, stream twice, compare with the first phase
  local name=$1 kind=$2 drafts=$3 t0=$SECONDS ids text
  client wait-drafter "127.0.0.1:$GATEWAY_PORT" "$kind" --timeout 120
  ids=$(client generate "127.0.0.1:$GATEWAY_PORT" "$PROMPT" --max-tokens "$MAX_TOKENS" --drafts "$drafts")
  text=$(cli_generate)
  printf 'smoke: %s: specdec generate streamed:\n%s\n' "$name" "$text"
  if [ -z "${REF_IDS:-}" ]; then
    REF_IDS=$ids REF_TEXT=$text
  else
    [ "$ids" = "$REF_IDS" ] || die "$name: token ids differ from the first phase:\n  $REF_IDS\n  $ids"
    [ "$text" = "$REF_TEXT" ] || die "$name: specdec generate's text differs from the first phase"
    echo "smoke: $name: token ids and text identical to the first phase"
  fi
  if [ "$kind" != none ]; then   # the drafter shares the verifier's network namespace: steps take its local lane
    dc logs verifier 2>&1 | grep "drafter $kind connected" | tail -1 | grep -q "steps over the local lane" \
      || die "$name: the verifier's last '$kind connected' log line does not say 'steps over the local lane'"
    echo "smoke: $name: the verifier's steps go over the drafter's local lane"
  fi
  if [ "$kind" = mtp ]; then   # and the MTP drafter takes device steps: rows and drafts through shared memory
    dc logs verifier 2>&1 | grep "drafter $kind connected" | tail -1 | grep -q "device steps" \
      || die "$name: the verifier's last '$kind connected' log line does not say 'device steps'"
    echo "smoke: $name: the MTP drafter takes device steps (overlapped steps through shared memory)"
  fi
  [ "$(cid verifier)" = "$verifier" ] && [ "$(started_at "$verifier")" = "$verifier_started" ] \
    || die "$name: the verifier container was recreated or restarted"
  [ "$(cid gateway)" = "$gateway" ] || die "$name: the gateway container was recreated"
  echo "smoke: $name: verifier ${verifier:0:12} and gateway ${gateway:0:12} untouched; drafter $(cid drafter | cut -c1-12)"
  TIMES[$name]=$(( SECONDS - t0 ))
}

say "phase mtp: the drafter from compose.yaml's default"
phase mtp mtp required
say "HTTP: the OpenAI-compatible API on the published HTTP port"
python3 - "$HTTP_PORT" "$PROMPT" <<'PY' || die "the HTTP API on port $HTTP_PORT did not answer a completion"
import json, sys, urllib.request
body = json.dumps({"prompt": sys.argv[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/completions", body,
                                 {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=120))
assert answer["usage"]["completion_tokens"] == 8, answer
print("smoke: HTTP /v1/completions:", json.dumps(answer["choices"][0]["text"]))
PY
say "phase ngram: DRAFTER=ngram docker compose ... up -d --wait drafter"
timed swap env DRAFTER=ngram docker compose -f compose/compose.yaml -f compose/compose.cpu.yaml --profile cpu \
  up -d --wait --wait-timeout 300 drafter
phase ngram ngram required
say "phase none: docker compose ... up -d --wait --scale drafter=0"
timed scale0 dc up -d --wait --wait-timeout 300 --scale drafter=0
[ -z "$(cid drafter)" ] || die "a drafter container still runs after --scale drafter=0"
phase none none none
say "phase mtp-again: docker compose ... up -d --wait --scale drafter=1"
timed scale1 dc up -d --wait --wait-timeout 300 --scale drafter=1
phase mtp-again mtp required

if [ "$gpu_check" = 1 ]; then
  say "GPU variant (no GPU here): compose config, and compose/Dockerfile.gpu built over the CPU torch stage"
  timed gpu bash compose/gpu-check.sh "$BASE_IMAGE" "$TORCH_FROM"
fi

say "down: docker compose ... down -v"
timed down dc down -v --remove-orphans
[ -z "$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")" ] \
  || die "containers of $COMPOSE_PROJECT_NAME are left after down -v"

say "passed: greedy output identical across mtp, ngram, no drafter and mtp again; verifier ${verifier:0:12} kept"
for key in engine base build up mtp swap ngram scale0 none scale1 mtp-again gpu down; do
  [ -n "${TIMES[$key]:-}" ] && printf '  %-10s %4d s\n' "$key" "${TIMES[$key]}"
done
printf '  %-10s %4d s\n' total "$(( $(date +%s) - START ))"
