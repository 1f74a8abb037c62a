#!/usr/bin/env bash
# A local base image for compose/Dockerfile.* when no container registry can be reached (no `FROM python:...`):
# Debian bookworm (minbase) with python3 + python3-venv + ca-certificates, made by debootstrap and
# `docker import`. Prints the image name (stdout, last line); all progress goes to stderr.
#
#   BASE_IMAGE=$(bash compose/base-image.sh)    # then: docker compose ... build --build-arg BASE_IMAGE=$BASE_IMAGE
#
# Cached: the image is tagged by a hash of its recipe (suite, packages, mirror) and of this host's CA bundle, and
# reused while younger than SPECDEC_BASE_MAX_AGE_DAYS (default 7, so Debian's security updates come in);
# --refresh rebuilds it. The host's CA bundle replaces the image's own, so that pip inside builds trusts what
# this host trusts (e.g. a TLS-inspecting proxy). Needs root, debootstrap and a running Docker engine.
set -euo pipefail

SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
MAX_AGE_DAYS=${SPECDEC_BASE_MAX_AGE_DAYS:-7}
HOST_CA=/etc/ssl/certs/ca-certificates.crt
REPO=specdec-base

log() { echo "base-image: $*" >&2; }
die() { echo "base-image: error: $*" >&2; exit 1; }

refresh=0
case "${1:-}" in
  "") ;;
  --refresh) refresh=1 ;;
  -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument '$1' (expected --refresh or nothing)" ;;
esac
[[ "$MAX_AGE_DAYS" =~ ^[0-9]+$ ]] || die "SPECDEC_BASE_MAX_AGE_DAYS='$MAX_AGE_DAYS' is not a whole number of days"
command -v docker > /dev/null || die "no docker CLI (run compose/engine.sh first)"
docker info > /dev/null 2>&1 || die "the Docker engine does not answer (run compose/engine.sh first)"

ca_sum=$( [ -f "$HOST_CA" ] && sha256sum "$HOST_CA" | cut -c1-64 || echo none )
recipe_sum=$(printf '%s\n' "$SUITE" "$PACKAGES" "$MIRROR" "$ca_sum" "trim-v1" | sha256sum | cut -c1-12)
image="$REPO:$SUITE-$recipe_sum"

if [ "$refresh" = 0 ] && created=$(docker image inspect --format '{{.Created}}' "$image" 2>/dev/null); then
  age_days=$(( ( $(date +%s) - $(date -d "$created" +%s) ) / 86400 ))
  if [ "$age_days" -lt "$MAX_AGE_DAYS" ]; then
    log "reusing $image (made ${age_days} d ago; rebuilt after ${MAX_AGE_DAYS} d or with --refresh)"
    echo "$image"
    exit 0
  fi
  log "$image is ${age_days} d old: rebuilding"
fi

[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap > /dev/null || die "debootstrap is not installed (apt-get install -y debootstrap)"
rootfs=$(mktemp -d /var/tmp/specdec-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
start=$(date +%s)
log "debootstrap $SUITE (minbase + $PACKAGES) from $MIRROR into $rootfs ..."
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" > "$rootfs.log" 2>&1; then
  tail -n 30 "$rootfs.log" >&2
  die "debootstrap failed (full log: $rootfs.log)"
fi
rm -f "$rootfs.log"
# What an image needs no copy of: package lists and caches, documentation, manual pages, translations.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
       "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*
[ -f "$HOST_CA" ] && cp "$HOST_CA" "$rootfs/etc/ssl/certs/ca-certificates.crt"
log "importing $image ..."
tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE ($MIRROR)" - "$image" > /dev/null
docker tag "$image" "$REPO:$SUITE"
log "made $image in $(( $(date +%s) - start )) s, $(docker image inspect --format '{{.Size}}' "$image" \
  | awk '{printf "%.0f MB", $1 / 1e6}'), python $(docker run --rm "$image" python3 -c \
  'import platform; print(platform.python_version())')"
echo "$image"
