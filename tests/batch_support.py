"""What the batched-generation tests share (tests/test_batch.py and
tests/test_batch_trees.py): the prompts, and the drivers of a
:class:`mlx_mtp.batching.DraftBatch` as the API runs it."""

from __future__ import annotations

#: prompts of differing lengths and kinds (text, chat messages, raw text)
PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue, and then say what colour the sun is "
    "at noon and at sunset, and why.",
    [
        {"role": "system", "content": "You answer in one short line."},
        {"role": "user", "content": "Name a prime number above 10."},
    ],
    "Hi",
    "Write a haiku about the sea.",
]
N = 24


def run_draft_batch(batch, prompts, limits, max_batch, remove_at=None):
    """Drive a DraftBatch as the API does (prompts join in order as rows
    leave); ``remove_at=(step, index)`` drops one prompt mid-generation.
    Returns each prompt's tokens (None for the removed one)."""
    out, uid_of, waiting, steps = {}, {}, list(range(len(prompts))), 0
    while waiting or len(batch):
        while waiting and len(batch) < max_batch:
            i = waiting.pop(0)
            uid, got = batch.add(prompts[i], limits[i])
            uid_of[uid], out[i] = i, list(got.tokens)
        for got in batch.step():
            out[uid_of[got.uid]].extend(got.tokens)
        steps += 1
        if remove_at and steps == remove_at[0]:
            uid = next(u for u, i in uid_of.items() if i == remove_at[1])
            batch.remove(uid)
            out[remove_at[1]] = None
    return [out[i] for i in range(len(prompts))]


def always_draft(batch):
    """Make every pass as wide as the longest draft (rows with shorter or no
    drafts padded), so rejected slots pile up in the cache."""
    batch._width = lambda drafts, per=1: (max(len(d.tokens) for d in drafts), 0.0)
    batch.compact_at = 1.0
