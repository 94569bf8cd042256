#!/usr/bin/env bash
# Collect every wheel the image needs into an ignored folder of the build context, so that
# `docker build` installs with `pip install --no-index` and needs no network.
#
#   bash docker/build_wheelhouse.sh                    # CPU: .[cpu] -> .docker/wheels
#   FORKRL_EXTRA=gpu bash docker/build_wheelhouse.sh   # GPU: .[gpu] -> .docker/wheels-gpu
#
# Uses this machine's pip and its configuration: the CPU extra pins torch==2.13.0+cpu, which PyPI does
# not have. Here pip finds it through its configured find-links; elsewhere set
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# The Python running pip must have the image's minor version (3.11 for python:3.11-slim / bookworm).
# Also downloads the Debian packages the image needs and cannot apt-get (no network in the build), with
# their dependencies, into .docker/debs/ (installed there only when missing from the base image):
#   base/   libnuma1 (vLLM's _C links libnuma.so.1) and g++ (torch inductor compiles vLLM's CPU sampler
#           ops at run time, even with enforce_eager)
#   pydev/  libpython3.11-dev (those kernels include Python.h; python:3.11-slim has it, Debian's python3 not)
# Only on a Debian bookworm host (the image's distribution); elsewhere build with network and
#   --build-arg EXTRA_APT_PACKAGES="libnuma1 g++"
# Cached: skipped while the requirement list and this script are unchanged (FORCE=1 to redo).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRA=${FORKRL_EXTRA:-cpu}
if [ "$EXTRA" = cpu ]; then OUT=${WHEELS_DIR:-.docker/wheels}; else OUT=${WHEELS_DIR:-.docker/wheels-$EXTRA}; fi
DEBS=.docker/debs
if [ -n "${PYTHON:-}" ]; then :; elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
IMAGE_PY=${IMAGE_PYTHON_VERSION:-3.11}

have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$have" != "$IMAGE_PY" ]; then
  echo "[wheels] $PYTHON is Python $have; the image has $IMAGE_PY (set PYTHON=python$IMAGE_PY)" >&2
  exit 1
fi

# The requirement list the image installs: project dependencies + the extra, from pyproject.toml.
reqs=$("$PYTHON" - "$EXTRA" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"][sys.argv[1]]))
PY
)
DEB_BASE="libnuma1 g++"
DEB_PYDEV="libpython3.11-dev"
stamp="$OUT.stamp"   # beside the folder, not in it: the folder is the image's build input
want="$EXTRA $( (echo "$reqs"; cat docker/build_wheelhouse.sh) | sha256sum | cut -c1-16)"
debs_want="$DEB_BASE | $DEB_PYDEV"

# ---- Debian packages (skipped when already fetched for this list)
fetch_debs() {  # fetch_debs DIR PACKAGE... : the packages and everything they depend on
  local dir=$1; shift
  rm -rf "$dir"; mkdir -p "$dir"
  # shellcheck disable=SC2046
  (cd "$dir" && apt-get download -o APT::Sandbox::User=root $(apt-cache depends --recurse --no-recommends \
      --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "$@" | grep '^[a-z0-9]' | sort -u) \
    >/dev/null)
}
mkdir -p "$DEBS"
codename=$(. /etc/os-release 2>/dev/null; echo "${VERSION_CODENAME:-}")
if [ "${FORCE:-0}" != 1 ] && [ -f "$DEBS.stamp" ] && [ "$(cat "$DEBS.stamp")" = "$debs_want" ]; then
  echo "[debs] $DEBS is up to date ($(find "$DEBS" -name '*.deb' | wc -l) packages)"
elif [ "$codename" = bookworm ] && command -v apt-get >/dev/null; then
  t=$(date +%s)
  fetch_debs "$DEBS/base" $DEB_BASE
  fetch_debs "$DEBS/pydev" $DEB_PYDEV
  echo "$debs_want" > "$DEBS.stamp"
  echo "[debs] $(find "$DEBS" -name '*.deb' | wc -l) packages, $(du -sh "$DEBS" | cut -f1) in $(( $(date +%s) - t )) s"
else
  echo "[debs] not a Debian bookworm host: none fetched; build with network and" \
       "--build-arg EXTRA_APT_PACKAGES=\"$DEB_BASE\"" >&2
fi

# ---- wheels
if [ "${FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[wheels] $OUT is up to date ($(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1))"
  exit 0
fi

mkdir -p "$OUT"
t0=$(date +%s)
echo "$reqs" > "$OUT/requirements.txt"   # the Dockerfile installs exactly this list
echo "[wheels] pip wheel .[$EXTRA] -> $OUT"
if ! nice "$PYTHON" -m pip wheel --quiet --disable-pip-version-check -w "$OUT" -r "$OUT/requirements.txt" \
    >"$OUT.log" 2>&1; then
  tail -30 "$OUT.log" >&2
  echo "[wheels] pip wheel failed (full log: $OUT.log)" >&2
  exit 1
fi
t1=$(date +%s)
echo "$want" > "$stamp"
echo "[wheels] $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1), pip wheel $((t1 - t0)) s"
