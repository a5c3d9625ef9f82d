#!/usr/bin/env bash
# XLA backend tests (tests/test_xla.py) in a virtual environment of their own: torch_xla 2.9.0, the
# newest on PyPI, needs torch 2.9.x, while the main test environment has a newer torch (torch_xla
# does not import there). On a fresh machine this downloads ~3.3 GB (the CUDA build of torch, which
# runs on the CPU; ~7 GB on disk) once; later runs reuse the environment.
#
#   .ci/xla_tests.sh                      # the venv in build/xla-venv (ignored by git)
#   ONEDIST_XLA_VENV=/tmp/xla .ci/xla_tests.sh -k ws1     # another place; extra args go to pytest
#
# Then all of the training loop's tests (accumulation, precision, sharding, od.join: gloo, shm and
# serial; mpi4py's skip) in the same venv: they reach into DDP's and FSDP2's internals, which
# change between torch releases (od.join broke on torch < 2.13 until DDP's buffer switch was read
# through a name every release has), and this venv's torch is the oldest the project meets (~80 s).
#
# Fails loudly: when torch_xla does not import, and when a test is skipped for lack of it
# (ONEDIST_REQUIRE_XLA=1 turns that skip into a failure).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${ONEDIST_XLA_VENV:-$PWD/build/xla-venv}"
TORCH_VERSION="${ONEDIST_XLA_TORCH:-2.9.1}"
TORCH_XLA_VERSION="${ONEDIST_XLA_TORCH_XLA:-2.9.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "xla_tests: creating $VENV (torch $TORCH_VERSION + torch_xla $TORCH_XLA_VERSION)"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==$TORCH_VERSION" "torch-xla==$TORCH_XLA_VERSION" \
    pytest pytest-timeout python-hostlist scikit-learn
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .

if ! PJRT_DEVICE=CPU "$VENV/bin/python" -c \
    'import torch, torch_xla, onedist as od; assert "xla-tpu" in od.available_backends(), od.available_backends(); print("xla_tests: torch", torch.__version__, "torch_xla", torch_xla.__version__)'; then
    echo "xla_tests: FAILED: torch_xla does not work in $VENV (see above)" >&2
    exit 1
fi

# CPU_NUM_DEVICES from the caller would change what the tests spawn: they set it themselves
env -u CPU_NUM_DEVICES PJRT_DEVICE=CPU ONEDIST_REQUIRE_XLA=1 \
    "$VENV/bin/python" -m pytest tests/test_xla.py -p no:cacheprovider -q -rsx --timeout=1200 "$@"

# pyproject's pytest options point at this checkout's src and tests (pythonpath): same code, older torch
"$VENV/bin/python" -m pytest tests/test_loop.py tests/test_sharding.py tests/test_join.py \
    -p no:cacheprovider -q -rsx --timeout=300
