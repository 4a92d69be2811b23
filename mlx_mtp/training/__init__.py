"""On-device training: CLP heads and span predictor (``clp``), self-distilled MTP
adaptation (``mtp``), learned mask embeddings (``masks``), and the model's own
greedy continuations all three learn from (``continuations``)."""
