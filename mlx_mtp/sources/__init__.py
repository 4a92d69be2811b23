"""Draft sources: where draft tokens come from, each a small class.

A source proposes candidates under the current root and learns from what was
committed; methods compose them (``pld`` is one prompt-lookup chain,
``hybrid`` merges every source into one draft tree, :mod:`mlx_mtp.allocate`).
Their candidates are valued with the planner's acceptance estimates
(``ctx.acceptance``), and the planner decides how much of them a step sends.

- :mod:`.lookup`: prompt lookup (n-gram matches in the context, Saxena 2023).
- :mod:`.pool`: the model's own earlier predictions, and lookahead's n-gram pool.
- :mod:`.masks`: ESP's mask vectors and the candidates their slots predict.
- :mod:`.native`: a checkpoint's own MTP layer (Qwen3.5 / Qwen3-Next, DeepSeek nextn).
"""
