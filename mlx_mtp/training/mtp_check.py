"""A held-out check of an MTP-adapted model in a minute, before a long
decoding evaluation (``mlx-mtp train mtp`` prints it at the end;
``examples/confadapt_heldout.py`` runs it on saved adapters).

Teacher-forced on the base model's greedy continuations of held-out prompts,
one forward pass per prompt:

- *next-token agreement*: the share of continuation positions where the
  adapted model's argmax equals the base model's greedy token (below 1.0 the
  adaptation moved next-token prediction; a gated LoRA keeps it at 1.0);
- *mask accuracy by slot*: after anchors every ``stride`` positions, k-1
  mask tokens as in ConfAdapt decoding; slot s is right where its argmax is
  the greedy token at anchor + 1 + s;
- *ConfAdapt proxy per tau*: the block ConfAdapt would emit at each anchor
  (the leading positions whose top-1 probability is at least tau, at least
  one; Kirchenbauer et al., §3): its mean length (an estimate of Eff. k) and
  the share of its tokens that equal the greedy reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..data import spec_bench_sample
from ..methods.confadapt import confadapt_length
from .continuations import greedy_continuations
from .mtp import encode_prompt, forward_layout, region_layout


def heldout_check(
    model: Any,
    mask_id: int,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    k: int = 16,
    stride: int = 8,
    taus: Sequence[float] = (0.9, 0.6),
    progress: bool = False,
) -> dict[str, Any]:
    """Score an adapted model on the base model's greedy continuations.

    Args:
        model: the adapted model (mask token in its embedding; positional
            RoPE installed, :func:`mlx_mtp.cache_view.install_positional_rope`).
        mask_id: the mask token's id.
        prompts: token ids per prompt.
        continuations: the base model's greedy tokens after each prompt.
        k: block size (1 real slot, k-1 mask slots).
        stride: positions between anchors.
        taus: ConfAdapt confidence thresholds to score.

    Returns:
        ``ntp_agreement`` (float), ``positions`` (int), ``mask_accuracy``
        (k-1 floats, by slot), ``taus``: per tau ``{"eff_k", "right"}``.

    Raises:
        ValueError: no prompts, or ``k`` < 2.
    """
    if not prompts or k < 2:
        raise ValueError("heldout_check needs prompts and k >= 2")
    ntp_hit = ntp_n = 0
    slot_hit, slot_n = np.zeros(k - 1), np.zeros(k - 1)
    emit = {t: [0, 0, 0] for t in taus}  # blocks, emitted tokens, emitted right
    pairs = list(zip(prompts, continuations))
    for prompt, cont in tqdm(pairs, desc="held-out check", disable=not progress, leave=False):
        real = list(prompt) + list(cont)
        g0 = len(prompt)
        anchors = list(range(g0 - 1, len(real) - 1, stride))
        if not anchors:
            continue
        lay = region_layout(len(real), anchors, [k] * len(anchors))
        ids = mx.array(real + [mask_id] * lay.n_slots)
        logits = forward_layout(model, ids, lay).astype(mx.float32)
        if mask_id < logits.shape[-1]:  # an input-only token, as in ConfAdapt's steps
            logits[:, mask_id] = -mx.inf
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        arg = np.array(mx.argmax(logp, axis=-1))
        conf = np.array(mx.exp(mx.max(logp, axis=-1)))
        truth = np.array(real)
        rows = np.arange(g0 - 1, len(real) - 1)
        ntp_hit += int((arg[rows] == truth[rows + 1]).sum())
        ntp_n += len(rows)
        for p, st in zip(anchors, lay.slot_start):
            block_rows = [p] + [st + s for s in range(k - 1)]
            pos = [p + 1 + i for i in range(k)]
            valid = [q < len(real) for q in pos]
            ok = [valid[i] and arg[r] == truth[pos[i]] for i, r in enumerate(block_rows)]
            for s in range(1, k):
                if valid[s]:
                    slot_n[s - 1] += 1
                    slot_hit[s - 1] += ok[s]
            for t in taus:
                n = min(confadapt_length(conf[block_rows], t), sum(valid))
                e = emit[t]
                e[0] += 1
                e[1] += n
                e[2] += sum(ok[:n])
    return {
        "ntp_agreement": ntp_hit / max(ntp_n, 1),
        "positions": ntp_n,
        "mask_accuracy": (slot_hit / np.maximum(slot_n, 1)).tolist(),
        "taus": {
            f"{t:g}": {"eff_k": n / max(b, 1), "right": r / max(n, 1)}
            for t, (b, n, r) in emit.items()
        },
    }


def check_lines(result: dict[str, Any], what: str) -> list[str]:
    """:func:`heldout_check`'s result as lines for a person."""
    acc = " / ".join(f"{a:.2f}" for a in result["mask_accuracy"][:3])
    lines = [
        f"held-out check ({what}): next-token agreement {result['ntp_agreement']:.3f} "
        f"({result['positions']} positions); mask accuracy slot 1 / 2 / 3: {acc}"
    ]
    for t, r in result["taus"].items():
        lines.append(
            f"  tau {t}: Eff. k (proxy) {r['eff_k']:.2f}, emitted tokens right {r['right']:.3f}"
        )
    return lines


def trainer_check(trainer: Any, per_task: int = 1, tokens: int = 64) -> dict[str, Any]:
    """:func:`heldout_check` of a :class:`~mlx_mtp.training.mtp.Trainer`'s
    student on the first ``per_task`` Spec-Bench prompts of each task (among
    the evaluation prompts every trainer leaves out), against the base
    model's greedy continuations of ``tokens`` tokens."""
    cut = trainer.cfg.max_prompt_tokens
    prompts = [
        encode_prompt(trainer.tokenizer, q["turns"][0], trainer.prompt_format)[-cut:]
        for q in spec_bench_sample(per_task)
    ]
    seqs = greedy_continuations(trainer.gen_model, prompts, tokens, trainer.eos, progress=False)
    conts = [s.generated for s in seqs]
    return heldout_check(trainer.student, trainer.mask_id, prompts, conts)
