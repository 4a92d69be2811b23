"""Mask hit rates before and after training (issue 7's figure; ESP, Goel et al. §3).

For every first-turn ``ntp`` output recorded by an ``mlx-mtp bench`` run (the
model's own greedy continuation, float32), each decoding position t gets mask
slots appended after it, teacher forced; slot j must predict the token at
t + 2 + j. Reported: top-1 and top-5 hit rates of slot 1 (t+2) and slot 2 (t+3)
for

* ``mean``: the paper's initialisation, the prompt's mean token embedding in
  every slot (before ESP's online update, docs/methods.md, probe), and
* ``learned``: the learned mask embeddings for the model
  (``mlx-mtp train masks``; the shipped ones by default).

The 48 evaluation prompts (``spec_bench_sample(8)``) are never in the mask
training data, so these are held-out figures.

    python examples/mask_hit_rates.py --from-bench docs/results/smollm2-cpu-48 \\
        [--masks FILE] [--out hits.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: loads OpenBLAS ahead of mlx on Linux)

# isort: split
from tqdm import tqdm

from mlx_mtp.bench.runner import recorded_outputs
from mlx_mtp.learned_masks import load_learned_masks
from mlx_mtp.loading import load_model
from mlx_mtp.training.continuations import TrainSequence
from mlx_mtp.training.masks import eval_masks, mean_prompt_vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-bench", required=True, help="an mlx-mtp bench --out folder")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--masks", default=None, help="learned masks file (default: found by model)")
    ap.add_argument("--out", default=None, help="also write the table here (JSON)")
    args = ap.parse_args()

    lm = load_model(args.model, dtype="float32")
    learned = load_learned_masks(lm.model, args.masks)
    slots = learned.shape[0]
    seqs = [
        TrainSequence(prompt, out)
        for prompt, out, _ in recorded_outputs(args.from_bench, lm.tokenizer, "ntp")
    ]
    table = {"bench": args.from_bench, "prompts": len(seqs), "slots": slots}
    for name, vectors in (
        ("mean", lambda s: mean_prompt_vectors(lm.model, [s], slots)),
        ("learned", learned),
    ):
        table[name] = eval_masks(lm.model, tqdm(seqs, desc=name), vectors, slots)
    for key in [k for k in table["mean"] if k.startswith("top")]:
        before, after = table["mean"][key], table["learned"][key]
        table.setdefault("ratio", {})[key] = after / before if before else float("inf")
    text = json.dumps(table, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
