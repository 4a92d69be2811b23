"""On-device training of CLP heads and the span predictor (backbone frozen).

Xie & Zhou, *CLP* (arXiv 2606.10935; docs/methods.md, clp). Three phases:

1. **Self-distillation data.** The frozen backbone continues every prompt
   greedily (batched, left-padded); each decode step also yields the backbone's
   final-norm hidden state ``h_n``. A position n of a continuation gives one
   example: input ``(h_n, e_{n+1})`` with ``t_{n+1}`` the backbone's own token,
   targets ``t_{n+2} .. t_{n+1+k}`` (teacher forcing on the greedy sequence).
2. **Heads.** Cross-entropy of head j's logits (through the frozen LM head)
   against ``t_{n+1+j}``; AdamW; only the heads train.
3. **Span predictor** (and the gate baseline): labels are the longest run of
   correct head predictions (:func:`mlx_mtp.clp_format.span_labels`), loss is
   cross-entropy over the k+1 classes, input ``h_n``.

Checkpoints go to ``OUT/../.NAME.train/`` (the continuations with their hidden
states after every batch, :class:`mlx_mtp.training.continuations.Continuations`;
head weights and optimizer state every ``checkpoint_every`` steps); a rerun
with ``resume=True`` continues from them. Everything is seeded.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from ..artifacts import atomic_write, atomic_write_text, check_writable
from ..clp_format import (
    CLPHeads,
    base_config,
    count_params,
    gate_hidden_for,
    save_heads,
    span_labels,
)
from ..confadapt_format import tokenizer_eos_ids
from ..data import eval_prompts, read_prompts, render_prompt
from ..errors import InvalidArgumentError
from ..families import model_parts
from ..fingerprint import model_fingerprint
from .continuations import Continuations, TrainSequence


@dataclass
class TrainConfig:
    """Settings of ``mlx-mtp train clp`` (defaults are those of the shipped heads)."""

    k: int = 2
    bottleneck: int = 256
    #: residual blocks per head (:class:`~mlx_mtp.clp_format.ResBlockHead`)
    depth: int = 1
    max_new_tokens: int = 64
    max_prompt_tokens: int = 256
    limit: int | None = None
    gen_batch: int = 32
    gen_minutes: float | None = None
    epochs: int = 3
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    predictor_epochs: int = 20
    predictor_lr: float = 5e-3
    gate: bool = True
    val_fraction: float = 0.05
    checkpoint_every: int = 200
    seed: int = 0
    exclude_eval: bool = True
    data: list[str] = field(default_factory=list)
    #: teacher-forced training (:func:`train_clp_forced`): corpus JSONL files,
    #: window length, windows of the corpus, the regression loss' weight, how
    #: often the held-out top-1 is logged (steps) and how many positions the
    #: span predictor trains on
    corpus: list[str] = field(default_factory=list)
    window: int = 512
    windows: int | None = None
    reg_weight: float = 1.0
    eval_every: int = 200
    predictor_positions: int = 16384


# ---------------------------------------------------------------------- data
def examples(
    seqs: list[TrainSequence], k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flatten continuations (with hidden states) into training examples.

    Returns:
        ``H`` (N, D) float16 hidden states h_n, ``nxt`` (N,) the backbone's token
        n+1, ``tgt`` (N, k) tokens n+2..n+1+k (0 where missing), ``valid`` (N, k).
    """
    H, nxt, tgt, valid = [], [], [], []
    for seq in seqs:
        cont, hs = seq.generated, seq.hidden
        T = len(cont)
        c = np.array(cont + [0] * k, dtype=np.int64)
        for i in range(T - 1):  # the last token has no successor to predict
            H.append(hs[i])
            nxt.append(c[i])
            tgt.append(c[i + 1 : i + 1 + k])
            valid.append(np.arange(i + 1, i + 1 + k) < T)
    if not H:
        raise InvalidArgumentError("the continuations are too short to train on")
    return (
        np.stack(H),
        np.array(nxt, dtype=np.int64),
        np.stack(tgt).astype(np.int64),
        np.stack(valid),
    )


# ------------------------------------------------------------------ training
def _head_loss(clp: CLPHeads, lm_head, embed, h, nxt, tgt, valid):
    logits = clp.head_logits(h, embed(nxt), lm_head)  # (k, B, V)
    ce = nn.losses.cross_entropy(logits, tgt.T, reduction="none")  # (k, B)
    m = valid.T.astype(ce.dtype)
    return (ce * m).sum() / mx.maximum(m.sum(), 1)


def head_predictions(
    clp: CLPHeads, lm_head, embed, H: np.ndarray, nxt: np.ndarray, batch: int = 512
) -> np.ndarray:
    """Argmax of every head at every example: (N, k) int64."""
    out = []
    for i in range(0, len(H), batch):
        h = mx.array(H[i : i + batch]).astype(mx.float32)
        lg = clp.head_logits(h, embed(mx.array(nxt[i : i + batch])), lm_head)
        out.append(np.array(mx.argmax(lg, axis=-1)).T)
    return np.concatenate(out).astype(np.int64)


def _save_ckpt(ckdir: Path, module: nn.Module, opt: optim.Optimizer, state: dict) -> None:
    params = dict(tree_flatten(module.trainable_parameters()))
    opt_state = {f"opt.{k}": v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)}
    weights = {**params, **opt_state}
    atomic_write(ckdir / "heads_ckpt.safetensors", lambda t: mx.save_safetensors(str(t), weights))
    atomic_write_text(ckdir / "heads_state.json", json.dumps(state))


def _load_ckpt(ckdir: Path, module: nn.Module, opt: optim.Optimizer) -> dict | None:
    f, s = ckdir / "heads_ckpt.safetensors", ckdir / "heads_state.json"
    if not (f.is_file() and s.is_file()):
        return None
    w = mx.load(str(f))
    module.load_weights([(k, v) for k, v in w.items() if not k.startswith("opt.")], strict=False)
    opt_items = [(k[4:], v) for k, v in w.items() if k.startswith("opt.")]
    if opt_items:
        opt.state = tree_unflatten(opt_items)
    return json.loads(s.read_text())


def checkpoint_dir(out: str | Path) -> Path:
    """The folder of the checkpoints of a run that writes ``out``
    (``out/../.<name>.train``), which ``resume`` continues from."""
    out = Path(out)
    return out.parent / f".{out.name}.train"


def train_clp(
    loaded: Any,
    out: str | Path,
    cfg: TrainConfig,
    resume: bool = False,
    log: Any = print,
) -> dict[str, Any]:
    """Train CLP heads + span predictor (+ gate) for ``loaded`` and save to ``out``.

    Args:
        loaded: a :class:`mlx_mtp.loading.LoadedModel` (float32 recommended).
        out: heads folder to write (atomically, at the end).
        cfg: settings; ``cfg.data`` lists the prompt files.
        resume: continue from ``out/../.<name>.train`` checkpoints.
        log: where progress lines go.

    Returns:
        Metrics: head top-1 accuracy per offset and predictor accuracy on the
        held-out split, parameter counts, example counts, wall time.

    Raises:
        InvalidArgumentError: bad data or settings, or an ``out`` that cannot
            be written (checked before anything is written or trained).
    """
    t_start = time.time()
    if cfg.k < 1 or cfg.k > 8:
        raise InvalidArgumentError(f"k must be in [1, 8], got {cfg.k}")
    if not math.isfinite(cfg.lr) or cfg.lr < 0:
        raise InvalidArgumentError(f"lr (--lr) must be a finite number >= 0, got {cfg.lr}")
    out = Path(out)
    model = loaded.model
    model.eval()
    mx.random.seed(cfg.seed)
    _, lm_head, embed = model_parts(model)

    # ---- phase 1: self-distilled data (the prompts and the output folder are
    # checked before anything is written)
    ckdir = checkpoint_dir(out)
    seqs = _greedy_targets(loaded, cfg, out, ckdir, fresh=not resume, log=log)

    n_val = max(1, int(len(seqs) * cfg.val_fraction)) if len(seqs) > 1 else 0
    split = np.random.default_rng(cfg.seed + 3).permutation(len(seqs))
    val_seqs = [seqs[i] for i in split[:n_val]]
    train_seqs = [seqs[i] for i in split[n_val:]]
    H, nxt, tgt, valid = examples(train_seqs, cfg.k)
    log(f"{len(train_seqs)} training continuations, {len(H)} positions; {len(val_seqs)} held out")

    # ---- phase 2: heads
    clp, opt, steps_per_epoch, total, state = _new_heads(loaded, cfg, len(H), ckdir, resume, log)
    step = state["step"] if state else 0
    loss_and_grad = nn.value_and_grad(clp, lambda m, *a: _head_loss(m, lm_head, embed, *a))
    perm_rng = np.random.default_rng(cfg.seed + 1)
    perms = [perm_rng.permutation(len(H)) for _ in range(cfg.epochs)]
    bar = tqdm(total=total, initial=step, desc="heads", unit="step")
    ema = None
    while step < total:
        ep, s = divmod(step, steps_per_epoch)
        sel = perms[ep][s * cfg.batch_size : (s + 1) * cfg.batch_size]
        loss, grads = loss_and_grad(
            clp,
            mx.array(H[sel]).astype(mx.float32),
            mx.array(nxt[sel]),
            mx.array(tgt[sel]),
            mx.array(valid[sel]),
        )
        opt.update(clp, grads)
        mx.eval(clp.parameters(), opt.state, loss)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if step % cfg.checkpoint_every == 0 or step == total:
            _save_ckpt(ckdir, clp, opt, {"step": step, "loss": ema})
    bar.close()
    clp.eval()

    # ---- phase 3: span predictor (and gate) on "longest run of correct heads"
    pred = head_predictions(clp, lm_head, embed, H, nxt)
    labels = span_labels(pred, tgt, valid)
    results: dict[str, Any] = {}
    predictors = _train_predictors(clp, H, labels, cfg, log)

    # ---- held-out metrics
    if val_seqs:
        vH, vnxt, vtgt, vvalid = examples(val_seqs, cfg.k)
        vpred = head_predictions(clp, lm_head, embed, vH, vnxt)
        acc = [
            float(((vpred[:, j] == vtgt[:, j]) & vvalid[:, j]).sum() / max(vvalid[:, j].sum(), 1))
            for j in range(cfg.k)
        ]
        vlab = span_labels(vpred, vtgt, vvalid)
        results["val_head_top1"] = acc
        results["val_label_mean"] = float(vlab.mean())
        results.update(_predictor_scores(predictors, vH, vlab, "val"))
    results.update(
        train_positions=int(len(H)),
        train_label_hist=np.bincount(labels, minlength=cfg.k + 1).tolist(),
        head_params=count_params(clp) - sum(count_params(m) for _, m in predictors),
        predictor_params=count_params(clp.predictor),
        gate_params=count_params(clp.gate) if cfg.gate else 0,
        wall_s=round(time.time() - t_start, 1),
    )
    clp.config["training"] = {
        **{k: v for k, v in asdict(cfg).items() if k != "data"},
        "data": [Path(p).name for p in cfg.data],
        "metrics": results,
    }
    save_heads(clp, out)
    log(json.dumps(results, indent=2))
    return results


def _greedy_targets(
    loaded: Any, cfg: TrainConfig, out: Path, ckdir: Path, fresh: bool, log: Any
) -> list[TrainSequence]:
    """The backbone's greedy continuations (with hidden states) of the prompts
    of ``cfg.data``, kept in ``ckdir/continuations.jsonl`` after every batch.
    ``fresh`` empties ``ckdir`` first. The prompts and ``out``'s folder are
    checked before anything is written.

    Raises:
        InvalidArgumentError: unreadable prompts, an unwritable folder, or no
            continuation made within ``cfg.gen_minutes``.
    """
    rng = np.random.default_rng(cfg.seed)
    tok = loaded.tokenizer
    texts = []
    for path in cfg.data:  # shuffled per file; ``limit`` caps each file
        part = read_prompts(path, exclude=eval_prompts() if cfg.exclude_eval else ())
        rng.shuffle(part)
        texts.extend(part[: cfg.limit] if cfg.limit else part)
    rng.shuffle(texts)
    check_writable(out.parent)
    ckdir.mkdir(parents=True, exist_ok=True)
    if fresh:
        for f in ckdir.glob("*"):
            if f.is_file():
                f.unlink()
    prompts = [render_prompt(tok, [{"role": "user", "content": t}]) for t in texts]
    # by length (:func:`train_clp`'s held-out split permutes this order)
    prompts = sorted((p[-cfg.max_prompt_tokens :] for p in prompts), key=len)
    conts = Continuations(
        loaded.model,
        prompts,
        cfg.max_new_tokens,
        set(tokenizer_eos_ids(tok)),
        batch_size=cfg.gen_batch,
        hidden=True,
        path=ckdir / "continuations.jsonl",
        meta={"model_fingerprint": model_fingerprint(loaded.model)},
        own_file=True,
    )
    if conts.done:
        log(f"resumed {len(conts.done)} generated continuations from {conts.path}")
    budget = None if cfg.gen_minutes is None else 60.0 * cfg.gen_minutes
    seqs = conts.all(budget_s=budget)
    if len(seqs) < len(prompts):
        log(
            f"--gen-minutes {cfg.gen_minutes:g}: training on {len(seqs)} of {len(prompts)} "
            "prompts' continuations (--resume generates the rest)"
        )
    if not seqs:
        raise InvalidArgumentError(
            "no continuations were generated within --gen-minutes; give it more time"
        )
    return seqs


def _new_heads(
    loaded: Any, cfg: TrainConfig, positions: int, ckdir: Path, resume: bool, log: Any
) -> tuple[CLPHeads, optim.Optimizer, int, int, dict | None]:
    """Fresh ``resblock`` heads (span predictor and gate frozen) and their
    AdamW with a cosine schedule over ``cfg.epochs`` of ``positions``,
    continued from the checkpoint in ``ckdir`` with ``resume``.

    Returns:
        ``(heads, optimizer, steps per epoch, total steps, checkpoint state or None)``.
    """
    model = loaded.model
    config = base_config(
        model,
        loaded.name,
        cfg.k,
        "resblock",
        bottleneck=cfg.bottleneck,
        **({"depth": cfg.depth} if cfg.depth > 1 else {}),
        gate_hidden=gate_hidden_for(model.args.hidden_size, cfg.k) if cfg.gate else None,
    )
    clp = CLPHeads(config)
    mx.eval(clp.parameters())
    clp.predictor.freeze()
    if cfg.gate:
        clp.gate.freeze()
    steps_per_epoch = math.ceil(positions / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    sched = optim.cosine_decay(cfg.lr, max(total, 1), cfg.lr * 0.05)
    opt = optim.AdamW(learning_rate=sched, weight_decay=cfg.weight_decay)
    state = _load_ckpt(ckdir, clp, opt) if resume else None
    if state:
        log(f"resumed head training at step {state['step']}/{total}")
    return clp, opt, steps_per_epoch, total, state


def _train_predictors(
    clp: CLPHeads, H: np.ndarray, labels: np.ndarray, cfg: TrainConfig, log: Any
) -> list[tuple[str, nn.Module]]:
    """Train the span predictor (and the gate) on ``(H, labels)``; returns
    them by name, in eval mode."""
    clp.unfreeze()
    predictors = [("predictor", clp.predictor)] + ([("gate", clp.gate)] if cfg.gate else [])
    for name, module in predictors:
        _train_predictor(module, H, labels, cfg, log, name)
    clp.eval()
    return predictors


def _predictor_scores(
    predictors: list[tuple[str, nn.Module]], H: np.ndarray, labels: np.ndarray, prefix: str
) -> dict[str, float]:
    """Accuracy and overshoot (predicted span longer than the label) of each
    predictor on held-out ``(H, labels)``, keyed ``{prefix}_{name}_...``."""
    out = {}
    for name, module in predictors:
        p = np.array(mx.argmax(module(mx.array(H).astype(mx.float32)), axis=-1))
        out[f"{prefix}_{name}_accuracy"] = float((p == labels).mean())
        out[f"{prefix}_{name}_overshoot"] = float((p > labels).mean())
    return out


def _train_predictor(
    module: nn.Module, H: np.ndarray, labels: np.ndarray, cfg: TrainConfig, log: Any, name: str
) -> None:
    """Cross-entropy training of a span predictor or gate on (h_n, label)."""
    log(f"{name}: {count_params(module):,} parameters")
    steps_per_epoch = math.ceil(len(H) / 512)
    total = steps_per_epoch * cfg.predictor_epochs
    opt = optim.AdamW(
        learning_rate=optim.cosine_decay(cfg.predictor_lr, total, cfg.predictor_lr * 0.05),
        weight_decay=0.0,
    )
    module.train()

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    lg = nn.value_and_grad(module, loss_fn)
    rng = np.random.default_rng(cfg.seed + 2)
    Hm = mx.array(H).astype(mx.float32)
    ym = mx.array(labels)
    for _ in tqdm(range(cfg.predictor_epochs), desc=name, unit="epoch"):
        perm = mx.array(rng.permutation(len(H)))
        for s in range(steps_per_epoch):
            sel = perm[s * 512 : (s + 1) * 512]
            loss, g = lg(module, Hm[sel], ym[sel])
            opt.update(module, g)
            mx.eval(module.parameters(), opt.state)
    module.eval()


# ------------------------------------------------- teacher-forced targets
def output_rows(model: nn.Module) -> mx.array | None:
    """The output projection ``W`` (V, D) when the model's logits are exactly
    ``h @ W.T`` (no soft-capping, scale or quantized head), checked on a
    random state; None otherwise (training then uses the full softmax)."""
    _, lm_head, embed = model_parts(model)
    head = getattr(model, "lm_head", None)
    W = getattr(head, "weight", None) if isinstance(head, nn.Linear) else None
    if W is None and type(embed) is nn.Embedding:
        W = embed.weight
    if W is None or W.ndim != 2:
        return None
    h = mx.random.normal((1, W.shape[1]), key=mx.random.key(0)).astype(W.dtype)
    ref = lm_head(h)
    got = h @ W.T
    if ref.shape != got.shape or not mx.allclose(ref, got, rtol=1e-3, atol=1e-3).item():
        return None
    return W


def forced_top1(
    clp: CLPHeads, lm_head, embed, ex: dict[str, np.ndarray], sel: np.ndarray, batch: int = 256
) -> dict[str, list[float]]:
    """Top-1 agreement of every head with the backbone at positions ``sel`` of
    teacher-forced examples (:func:`mlx_mtp.training.forced.forced_examples`):
    ``all`` over every position, ``consistent`` over positions whose inputs are
    the backbone's own tokens (as at decode time). Lists of k fractions."""
    pred = head_predictions(clp, lm_head, embed, ex["H"][sel], ex["nxt"][sel], batch)
    return _top1(pred == ex["tgt"][sel], ex["consistent"][sel])


def _top1(hits: np.ndarray, consistent: np.ndarray) -> dict[str, list[float]]:
    k = hits.shape[1]
    return {
        "all": [float(hits[:, j].mean()) for j in range(k)],
        "consistent": [
            float(hits[consistent[:, j], j].mean()) if consistent[:, j].any() else 0.0
            for j in range(k)
        ],
    }


def train_clp_forced(
    loaded: Any,
    out: str | Path,
    cfg: TrainConfig,
    train: list[str | Path | dict[str, np.ndarray]],
    eval_dirs: dict[str, str | Path],
    ckdir: str | Path,
    resume: bool = False,
    log: Any = print,
) -> dict[str, Any]:
    """Train CLP heads + span predictor on teacher-forced targets and save them.

    Head j learns the backbone's prediction ``a_{n+j}`` from ``(h_n, e(x_{n+1}))``
    (:func:`mlx_mtp.training.forced.forced_examples`), with two losses summed:
    a smooth-L1 regression of the head's state onto the backbone's own
    final-norm state ``h_{n+j}`` (weight ``cfg.reg_weight``; EAGLE's feature
    loss, Li et al. 2024, §3.2) and a cross-entropy over the batch's candidate
    tokens (the backbone's top-:data:`~mlx_mtp.training.forced.TOP` tokens at
    every target position of the batch), which costs a few thousand output
    rows instead of the whole vocabulary. Where the output projection is not a
    plain matrix (:func:`output_rows`) the cross-entropy is over the full
    vocabulary. The span predictor and gate then train as in :func:`train_clp`.

    Args:
        loaded: a :class:`mlx_mtp.loading.LoadedModel` (float32).
        out: heads folder to write (atomically, at the end).
        cfg: settings (``k``, ``bottleneck``, ``epochs``, ``batch_size``,
            ``lr``, ``reg_weight``, ``eval_every``, ``checkpoint_every``).
        train: the training targets: :class:`~mlx_mtp.training.forced.ForcedTargets`
            folders and arrays of windows in their layout
            (:func:`~mlx_mtp.training.forced.continuation_windows`).
        eval_dirs: held-out folders by name; every ``cfg.eval_every`` steps
            the heads' top-1 on up to 4,096 of their positions is logged, and
            on all of them at the end.
        ckdir: folder of the head checkpoints (``resume`` continues from them).

    Returns:
        Metrics: held-out top-1 per head and set (``all`` and ``consistent``
        positions), the curve logged during training, predictor accuracy,
        position counts, wall time.

    Raises:
        InvalidArgumentError: bad settings or no targets.
    """
    from .forced import forced_examples, load_shards, merge_examples

    t_start = time.time()
    if cfg.k < 1 or cfg.k > 8:
        raise InvalidArgumentError(f"k must be in [1, 8], got {cfg.k}")
    out, ckdir = Path(out), Path(ckdir)
    check_writable(out.parent)
    ckdir.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    model.eval()
    mx.random.seed(cfg.seed)
    _, lm_head, embed = model_parts(model)
    W = output_rows(model)

    ex = merge_examples(
        [forced_examples(t if isinstance(t, dict) else load_shards(t), cfg.k) for t in train]
    )
    evals = {name: forced_examples(load_shards(d), cfg.k) for name, d in eval_dirs.items()}
    N = len(ex["H"])
    log(
        f"{N} training positions; held out: "
        + ", ".join(f"{n} {len(e['H'])}" for n, e in evals.items())
    )
    probe_rng = np.random.default_rng(cfg.seed + 4)
    probes = {n: np.sort(probe_rng.permutation(len(e["H"]))[:4096]) for n, e in evals.items()}

    clp, opt, steps_per_epoch, total, state = _new_heads(loaded, cfg, N, ckdir, resume, log)
    step = state["step"] if state else 0
    curve: list[dict[str, Any]] = state.get("curve", []) if state else []

    H_all = ex["H_all"]

    def loss_fn(m, h, e, tgt_h, cand, cand_idx, tgt):
        states = m.head_states(h, e)  # (k, B, D)
        reg = nn.losses.smooth_l1_loss(states, tgt_h, reduction="mean")
        if cand is None:
            logits = lm_head(states)
        else:
            logits = states @ cand.T  # (k, B, C)
        ce = nn.losses.cross_entropy(
            logits, cand_idx if cand is not None else tgt, reduction="mean"
        )
        return cfg.reg_weight * reg + ce

    loss_and_grad = nn.value_and_grad(clp, loss_fn)
    perm_rng = np.random.default_rng(cfg.seed + 1)
    perms = [perm_rng.permutation(N) for _ in range(cfg.epochs)]
    bar = tqdm(total=total, initial=step, desc="heads", unit="step")
    ema = None
    while step < total:
        ep, s = divmod(step, steps_per_epoch)
        sel = np.sort(perms[ep][s * cfg.batch_size : (s + 1) * cfg.batch_size])
        rows = ex["tgt_row"][sel]  # (B, k)
        tgt = ex["tgt"][sel]
        tgt_h = mx.array(np.transpose(H_all[rows], (1, 0, 2))).astype(mx.float32)
        if W is not None:
            cands, inv = np.unique(
                np.concatenate([ex["top"][rows].reshape(-1), tgt.reshape(-1)]), return_inverse=True
            )
            cand_idx = inv[len(rows) * ex["top"].shape[1] * cfg.k :].reshape(tgt.shape).T
            cand = W[mx.array(cands)]
            cand_idx = mx.array(cand_idx)
        else:
            cand, cand_idx = None, None
        loss, grads = loss_and_grad(
            clp,
            mx.array(ex["H"][sel]).astype(mx.float32),
            embed(mx.array(ex["nxt"][sel])),
            tgt_h,
            cand,
            cand_idx,
            mx.array(tgt.T),
        )
        opt.update(clp, grads)
        mx.eval(clp.parameters(), opt.state, loss)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if evals and (step % cfg.eval_every == 0 or step == total):
            point = {"step": step, "positions": step * cfg.batch_size}
            for n, e in evals.items():
                point[n] = forced_top1(clp, lm_head, embed, e, probes[n])["all"]
            curve.append(point)
            bar.write("held-out top-1 " + json.dumps(point))
        if step % cfg.checkpoint_every == 0 or step == total:
            _save_ckpt(ckdir, clp, opt, {"step": step, "loss": ema, "curve": curve})
    bar.close()
    clp.eval()

    # span predictor (and gate) on "longest run of correct heads", from the
    # heads' full-vocabulary predictions on a sample of the training positions
    sample = np.sort(np.random.default_rng(cfg.seed + 2).permutation(N)[: cfg.predictor_positions])
    pred = head_predictions(clp, lm_head, embed, ex["H"][sample], ex["nxt"][sample])
    labels = span_labels(pred, ex["tgt"][sample], None)
    predictors = _train_predictors(clp, ex["H"][sample], labels, cfg, log)

    results: dict[str, Any] = {}
    for n, e in evals.items():
        vpred = head_predictions(clp, lm_head, embed, e["H"], e["nxt"])
        results[f"{n}_top1"] = _top1(vpred == e["tgt"], e["consistent"])
        vlab = span_labels(vpred, e["tgt"], None)
        results.update(_predictor_scores(predictors, e["H"], vlab, n))
    results.update(
        curve=curve,
        train_positions=int(N),
        predictor_positions=int(len(sample)),
        train_label_hist=np.bincount(labels, minlength=cfg.k + 1).tolist(),
        head_params=count_params(clp) - sum(count_params(m) for _, m in predictors),
        predictor_params=count_params(clp.predictor),
        gate_params=count_params(clp.gate) if cfg.gate else 0,
        wall_s=round(time.time() - t_start, 1),
    )
    clp.config["training"] = {
        **{k: v for k, v in asdict(cfg).items() if k not in ("data", "corpus")},
        "targets": "teacher-forced" + (" and greedy continuations" if cfg.data else ""),
        "corpus": [Path(p).name for p in cfg.corpus],
        "data": [Path(p).name for p in cfg.data],
        "metrics": results,
    }
    save_heads(clp, out)
    log(json.dumps({k: v for k, v in results.items() if k != "curve"}, indent=2))
    return results


def train_clp_corpus(
    loaded: Any,
    out: str | Path,
    cfg: TrainConfig,
    eval_data: list[str],
    target_minutes: float | None = None,
    resume: bool = False,
    log: Any = print,
) -> dict[str, Any]:
    """``train clp --corpus`` (and ``--data``): teacher-forced targets of
    ``cfg.corpus`` and of each held-out file, the backbone's greedy
    continuations of the prompts of ``cfg.data`` (if any) as windows of
    ``cfg.max_new_tokens`` tokens, then :func:`train_clp_forced` on both.

    The targets live in the checkpoint folder (``out/../.NAME.train/forced-*``
    and ``continuations.jsonl``) and are kept between runs while the model,
    the windows and the prompts are the same
    (:class:`~mlx_mtp.training.forced.ForcedTargets`,
    :class:`~mlx_mtp.training.continuations.Continuations`), so a stopped run
    resumes computing them; head checkpoints are continued only with
    ``resume``.

    Args:
        eval_data: held-out JSONL files (``spec-bench``: the packaged
            questions); 24 windows of each, never trained on.
        target_minutes: stop computing training targets after this many
            minutes and train on those made (the held-out ones are made first).

    Raises:
        InvalidArgumentError: bad files or settings, no targets made.
    """
    from ..data import SPEC_BENCH
    from .forced import ForcedTargets, continuation_windows, corpus_windows

    if not cfg.corpus and not cfg.data:
        raise InvalidArgumentError("train clp: give a corpus (--corpus), prompts (--data) or both")
    out = Path(out)
    check_writable(out.parent)
    ckdir = checkpoint_dir(out)
    ckdir.mkdir(parents=True, exist_ok=True)
    if not resume:
        for f in ckdir.glob("heads_*"):
            f.unlink()
    tok = loaded.tokenizer
    evals = {}
    for f in eval_data:
        path = SPEC_BENCH if f == "spec-bench" else Path(f).expanduser()
        name = "spec-bench" if f == "spec-bench" else f"{path.parent.name}-{path.stem}"
        w = corpus_windows(tok, [path], cfg.window, limit=24, seed=cfg.seed + 1)
        ForcedTargets(loaded.model, w, ckdir / f"forced-eval-{name}").compute(
            desc=f"held-out {name}"
        )
        evals[name] = ckdir / f"forced-eval-{name}"
    train: list[Any] = []
    if cfg.data:
        seqs = _greedy_targets(loaded, cfg, out, ckdir, fresh=False, log=log)
        greedy = continuation_windows(seqs, loaded.model, cfg.max_new_tokens)
        log(f"{len(greedy['tokens'])} greedy continuations of {cfg.max_new_tokens} tokens")
        train.append(greedy)
    if cfg.corpus:
        windows = corpus_windows(
            tok,
            cfg.corpus,
            cfg.window,
            limit=cfg.windows,
            seed=cfg.seed,
            exclude=eval_prompts() if cfg.exclude_eval else (),
        )
        targets = ForcedTargets(loaded.model, windows, ckdir / "forced-train")
        budget = None if target_minutes is None else 60.0 * target_minutes
        made = targets.compute(budget_s=budget, desc="targets")
        if made < targets.n_shards:
            log(
                f"training on {made} of {targets.n_shards} shards of targets "
                "(a rerun makes the rest)"
            )
        if made == 0:
            raise InvalidArgumentError(
                "no targets were made within --target-minutes; give it more time"
            )
        train.append(targets.folder)
    return train_clp_forced(loaded, out, cfg, train, evals, ckdir, resume=resume, log=log)
