#!/usr/bin/env bash
# Build a local stand-in for `python:3.11-slim` from Debian packages, for machines that cannot pull
# from an image registry. Debian bookworm ships Python 3.11, like python:3.11-slim.
#
#   sudo bash docker/build_base_image.sh                 # -> image forkrl-base:bookworm
#   FORKRL_BASE_IMAGE=my/base:tag bash docker/build_base_image.sh
#   docker build --network host --build-arg BASE_IMAGE=forkrl-base:bookworm -f docker/Dockerfile .
#
# The Debian mirror is read from this machine's apt sources at run time (whatever apt already uses);
# no host name is written here. Needs root, debootstrap and a running Docker engine.
# Skips the work when the image already exists (FORCE=1 to rebuild).
set -euo pipefail

IMAGE=${FORKRL_BASE_IMAGE:-forkrl-base:bookworm}
SUITE=${DEBIAN_SUITE:-bookworm}
DOCKER=${DOCKER:-docker}

if [ "${FORCE:-0}" != 1 ] && $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "[base] $IMAGE exists (FORCE=1 to rebuild)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "[base] needs debootstrap: apt-get install -y debootstrap" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "[base] debootstrap needs root" >&2; exit 1; }

# The mirror apt uses for the main archive of $SUITE (works for both sources.list and deb822 .sources).
MIRROR=${DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI) $(CODENAME) $(IDENTIFIER)' 2>/dev/null \
  | awk -v s="$SUITE" '$2 == s && $3 == "Packages" { print $1; exit }')}
if [ -z "$MIRROR" ]; then
  echo "[base] no apt source for '$SUITE' found on this machine; set DEBIAN_MIRROR" >&2
  exit 1
fi

ROOTFS=$(mktemp -d /tmp/forkrl-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
echo "[base] debootstrap $SUITE from the local apt mirror into $ROOTFS"
t0=$(date +%s)
nice debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || { tail -20 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"
# Slim it down a little, like the official slim images; keep apt usable offline-free (no lists).
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
# The mirror URL must not stay inside the image.
: > "$ROOTFS/etc/apt/sources.list"
# python:3.11-slim has `python`; Debian only has `python3`.
ln -sf python3 "$ROOTFS/usr/bin/python"
t1=$(date +%s)
tar -C "$ROOTFS" -c . | $DOCKER import \
  -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$IMAGE" >/dev/null
t2=$(date +%s)
echo "[base] built $IMAGE: debootstrap $((t1 - t0)) s, import $((t2 - t1)) s," \
  "$($DOCKER image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
