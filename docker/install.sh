#!/bin/sh
# The one Python install of attnserve, shared by the Dockerfile (builder stage) and CI
# (tests/deploy/test_deploy.py runs this very script into a fresh venv), so the two cannot drift apart.
#
#   docker/install.sh VENV TORCH_SPEC [SRC]
#
#   VENV        where to create the virtual environment (a clean one: no --system-site-packages).
#   TORCH_SPEC  the pip requirement for torch, e.g. 'torch==2.11.0' (the image, from the PyTorch
#               CUDA index) or 'torch==2.13.0' (CI: the CPU build these machines hold on disk).
#               torch is not pinned in pyproject.toml: which build is right depends on the machine.
#   SRC         the source tree holding pyproject.toml (default: the current directory).
#
# Environment:
#   PYTHON           interpreter that creates the venv (default: python3); the venv keeps using it,
#                    so the runtime image must have the same interpreter at the same path.
#   TORCH_INDEX_URL  if set, torch (and what it pulls: triton, nvidia-* CUDA libraries) comes from
#                    this index, e.g. https://download.pytorch.org/whl/cu128; otherwise from pip's
#                    configured indexes.
#   PIP_*            pip's own variables (PIP_NO_CACHE_DIR, PIP_FIND_LINKS, ...) pass through.
#
# Steps: venv -> torch -> the project and its pinned dependencies (pyproject.toml) -> the gRPC stubs
# (python -m service.grpc.protogen, as `make proto`) -> `pip check` -> an import smoke test.
set -eu

if [ "$#" -lt 2 ] || [ "$#" -gt 3 ]; then
    echo "usage: $0 VENV TORCH_SPEC [SRC]" >&2
    exit 2
fi
VENV=$1
TORCH_SPEC=$2
SRC=${3:-.}
PYTHON=${PYTHON:-python3}

if [ ! -f "$SRC/pyproject.toml" ]; then
    echo "$0: no pyproject.toml in $SRC" >&2
    exit 2
fi

echo "==> creating venv $VENV with $PYTHON"
"$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"

echo "==> installing $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$VPY" -m pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
    "$VPY" -m pip install "$TORCH_SPEC"
fi

TORCH_VERSION=$("$VPY" -c "import torch; print(torch.__version__)")

# Editable, as `make install` does: the package is importable from anywhere, and the gRPC stubs
# that protogen writes into the source tree afterwards are seen without reinstalling.
# torch is held at the exact build just installed: were the pins of pyproject.toml (triton==3.6.0)
# at odds with it, pip fails here instead of quietly swapping torch for another build.
echo "==> installing attnserve and its pinned dependencies from $SRC (torch held at $TORCH_VERSION)"
"$VPY" -m pip install --editable "$SRC" "torch==$TORCH_VERSION"

echo "==> generating gRPC stubs"
(cd "$SRC" && "$VPY" -m service.grpc.protogen)

echo "==> checking the environment"
"$VPY" -m pip check
"$VPY" -c "import torch, triton, service, kernels; print('torch', torch.__version__, 'triton', triton.__version__)"
