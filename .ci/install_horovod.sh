#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (PyTorch + Gloo; no MPI, TensorFlow or MXNet) into the python3
# on PATH, against the torch already installed there. Idempotent: does nothing when
# `import horovod.torch` works. Quiet; on failure prints the end of the build log and exits 1.
#
# Why a script and not `pip install horovod`: 0.28.1's CMakeLists force C++14, and torch >= 2.1
# headers need C++17 ("#error C++17 or later compatible compiler is required"). The sdist is
# patched to C++17 and built without build isolation, so it compiles against *this* torch.
# Needs cmake, g++ and make (installed with apt-get when missing and apt-get exists). 5-10
# minutes on 2 cores (9 min 50 s in a fresh venv on this project's shared 2-core machine).
#
# Usage: bash .ci/install_horovod.sh         (after `pip install torch==...`)
set -euo pipefail

PY=${PYTHON:-python3}
VERSION=0.28.1

importable() { (cd / && "$PY" -c "import horovod.torch" >/dev/null 2>&1); }

if importable; then
    echo "horovod: already installed ($(cd / && "$PY" -c 'import horovod; print(horovod.__version__)' 2>/dev/null))"
    exit 0
fi
if ! (cd / && "$PY" -c "import torch" >/dev/null 2>&1); then
    echo "horovod: install torch first (python3 -m pip install torch==2.13.0); Horovod builds against it" >&2
    exit 1
fi

missing=()
for tool in cmake g++ make; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
    if command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "horovod: the build needs ${missing[*]}; install them and run this script again" >&2
        exit 1
    fi
fi

WORK=$(mktemp -d)
LOG="$WORK/build.log"
trap 'rm -rf "$WORK"' EXIT
fail() {
    echo "horovod: $1 failed; last lines of the log:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
}

TORCH=$(cd / && "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
echo "horovod: building $VERSION against torch $TORCH (5-10 min on 2 cores)"
"$PY" -m pip install -q wheel packaging psutil cloudpickle pyyaml cffi >>"$LOG" 2>&1 || fail "installing the build dependencies"
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$VERSION" >>"$LOG" 2>&1 \
    || fail "downloading the horovod $VERSION sdist"
tar xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/horovod-$VERSION"
for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "horovod: $f has no C++14 line to patch" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
done
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip install --no-build-isolation --no-cache-dir "$SRC" >>"$LOG" 2>&1 || fail "building horovod"

importable || fail "importing horovod.torch after the build"
RUN=$(cd / && "$PY" -c 'import shutil, sys; print(shutil.which("horovodrun") or "")')
if [ -z "$RUN" ]; then
    echo "horovod: installed, but horovodrun is not on PATH (pip's scripts directory)" >&2
    exit 1
fi
CHECK=$(cd / && horovodrun --check-build 2>&1) || { echo "$CHECK" >&2; echo "horovod: horovodrun --check-build failed" >&2; exit 1; }
grep -q '\[X\] PyTorch' <<<"$CHECK" || { echo "$CHECK" >&2; echo "horovod: built without PyTorch support" >&2; exit 1; }
echo "horovod: $VERSION installed (PyTorch, Gloo): $RUN"
