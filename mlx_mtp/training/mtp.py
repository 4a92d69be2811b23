"""On-device MTP adaptation by online self-distillation (``mlx-mtp train mtp``).

Kirchenbauer et al., *Multi-Token Prediction via Self-Distillation* (arXiv
2602.06019; docs/methods.md, confadapt). A student and a frozen teacher start from the same
weights; the student's vocabulary gets one mask token. One training step:

1. A prompt and the teacher's greedy continuation of it (generated on the fly).
2. Several mask regions: after a position p of the continuation, k-1 mask
   tokens (k drawn from [2, 16]) at positions p+1 ... p+k-1. Each region sees
   the real tokens up to p and its own earlier masks; real tokens never see a
   mask (one forward pass, a block attention mask, per-token RoPE positions).
3. The student emits a block per region: its argmax at p and at the k-1 masks.
4. The teacher scores that block token by token given the student's own
   earlier drafts (student-forced): the drafts sit in the mask slots of the
   same layout, and the teacher's argmax at p and at each draft is the hard
   target of the student's prediction at p and at each mask. With
   ``forcing="teacher"`` the targets are the teacher's greedy continuation
   instead (see :func:`self_distillation_loss`).
5. Loss: cross-entropy of the student's mask predictions against those
   targets, plus (full fine-tuning and ungated LoRA) cross-entropy at the real
   continuation positions against the teacher's argmax, which holds
   next-token prediction near the teacher's.

Full fine-tuning (AdamW, lr 1e-5 after warm-up) writes a complete model folder
with the mask token added to the vocabulary (embedding and LM head resized,
tied embeddings included). LoRA mode trains low-rank deltas plus the mask
token's embedding row and writes a small adapter folder, keyed by the base
model's fingerprint, that ``--method confadapt`` applies on load. By default
the deltas are gated (:class:`~mlx_mtp.confadapt_format.GatedLoRALinear`,
after Samragh et al., arXiv 2507.11851 §3.3): they act only at mask tokens, so
real tokens, and with them every block's first token, stay exactly the base
model's. ``gated=False`` uses mlx-lm's plain LoRA, which the next-token loss
term only holds near the base model.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import save_config, save_model
from tqdm import tqdm

from ..artifacts import atomic_folder
from ..cache_view import FixedCache, install_positional_rope
from ..confadapt_format import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MASK_TOKEN,
    MaskedEmbedding,
    MaskGate,
    MTPMetadata,
    clone_modules,
    gated_lora_layers,
    get_module,
    lora_modules,
    tokenizer_eos_ids,
    tokenizer_mask_id,
    write_metadata,
)
from ..data import render_prompt
from ..dims import dense_weight
from ..errors import InvalidArgumentError
from ..fingerprint import model_fingerprint, model_signature
from .continuations import Continuations

#: linears adapted in LoRA mode (llama-style names)
LORA_KEYS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


#: where the mask slots' targets come from (see :func:`self_distillation_loss`)
FORCINGS = ("student", "teacher")


@dataclass
class TrainConfig:
    """Settings of one adaptation run (saved with every checkpoint).

    Attributes:
        steps: optimizer steps (one sequence each).
        lora: LoRA (True) or full fine-tuning.
        gated: LoRA deltas act only at mask tokens (next-token prediction
            stays the base model's); False: plain LoRA on every token.
        lr: peak learning rate (None: 1e-5 full, 5e-4 LoRA).
        warmup: linear warm-up steps, then cosine decay to 10%.
        rank, scale, lora_layers: LoRA rank, scale, number of last layers adapted.
        regions: mask regions per sequence.
        k_min, k_max: block size k is drawn uniformly from [k_min, k_max].
        gen_tokens: length of the teacher's continuation per prompt.
        reuse: consecutive steps that use one prompt (with new mask regions).
        max_prompt_tokens: prompts are cut to this many tokens (from the left).
        save_every: checkpoint interval in steps.
        seed: everything random (prompt order, regions) derives from it.
        forcing: ``"teacher"`` (targets from the teacher's greedy
            continuation; the default, the recipe that measured best on
            SmolLM2) or ``"student"`` (the paper's objective, which collapses
            on SmolLM2 into a filler token), see :func:`self_distillation_loss`.
    """

    steps: int = 100
    lora: bool = True
    gated: bool = True
    lr: float | None = None
    warmup: int = 5
    rank: int = 8
    scale: float = 10.0
    lora_layers: int = 1000
    regions: int = 12
    k_min: int = 2
    k_max: int = 16
    gen_tokens: int = 64
    reuse: int = 2
    max_prompt_tokens: int = 192
    save_every: int = 10
    seed: int = 0
    forcing: str = "teacher"

    def __post_init__(self) -> None:
        if self.forcing not in FORCINGS:
            raise InvalidArgumentError(
                f"forcing must be one of {', '.join(FORCINGS)}, not {self.forcing!r}."
            )
        if not self.lora:
            self.gated = False  # full fine-tuning has no LoRA deltas to gate

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else (5e-4 if self.lora else 1e-5)


# ----------------------------------------------------------------- data
def encode_prompt(tokenizer: Any, text: str, prompt_format: str) -> list[int]:
    """Token ids of one user message in ``prompt_format`` (``chat`` or ``plain``;
    :func:`mlx_mtp.data.render_prompt`)."""
    return render_prompt(
        tokenizer, [{"role": "user", "content": text}], prompt_format=prompt_format
    )


#: prompts per batched teacher generation
GEN_BATCH = 16


# ------------------------------------------------------- mask-region layout
@dataclass
class RegionLayout:
    """Real tokens followed by mask regions, as one forward pass.

    Attributes:
        n_real: number of real tokens (positions 0..n_real-1).
        anchors: (R,) position p of the last real token before each region.
        ks: (R,) block size k of each region (k-1 mask slots).
        slot_start: (R,) index of each region's first slot in the sequence.
        mask: (N, N) bool attention mask.
        positions: (N,) int32 RoPE positions.
    """

    n_real: int
    anchors: list[int]
    ks: list[int]
    slot_start: list[int]
    mask: np.ndarray
    positions: np.ndarray

    @property
    def n_slots(self) -> int:
        return int(sum(k - 1 for k in self.ks))


def region_layout(n_real: int, anchors: list[int], ks: list[int]) -> RegionLayout:
    """Attention mask and positions for mask regions after ``anchors``.

    Real token i sees real tokens <= i. Slot s of region r (s = 1..k-1, position
    anchors[r] + s) sees real tokens <= anchors[r] and the region's slots <= s.
    """
    n = n_real + sum(k - 1 for k in ks)
    mask = np.zeros((n, n), dtype=bool)
    mask[:n_real, :n_real] = np.tril(np.ones((n_real, n_real), dtype=bool))
    pos = np.zeros(n, dtype=np.int32)
    pos[:n_real] = np.arange(n_real)
    starts, at = [], n_real
    for p, k in zip(anchors, ks):
        starts.append(at)
        for s in range(1, k):
            row = at + s - 1
            mask[row, : p + 1] = True
            mask[row, at : row + 1] = True
            pos[row] = p + s
        at += k - 1
    return RegionLayout(n_real, list(anchors), list(ks), starts, mask, pos)


def forward_layout(model: nn.Module, tokens: mx.array, layout: RegionLayout) -> mx.array:
    """Logits (N, V) of ``tokens`` (N,) under ``layout`` (positional RoPE must
    be installed, see :func:`mlx_mtp.cache_view.install_positional_rope`)."""
    m = mx.array(layout.mask)
    p = mx.array(layout.positions)
    caches = [FixedCache(m, p) for _ in model.layers]
    return model(tokens[None], cache=caches)[0]


def region_rows(layout: RegionLayout) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the k predictions of every region, and the rows whose argmax
    fills each mask slot with a draft.

    Returns:
        ``pred_rows`` (sum k,): for each region, the anchor row then its k-1
        slot rows (prediction i = token at anchor + 1 + i). ``draft_src``
        (sum k-1,): for slot s of a region, the row whose argmax is the draft
        in that slot (the anchor for s = 1, slot s-1 after that).
    """
    pred, src = [], []
    for p, k, st in zip(layout.anchors, layout.ks, layout.slot_start):
        rows = [p] + [st + s for s in range(k - 1)]
        pred += rows
        src += rows[:-1]
    return np.array(pred, dtype=np.int32), np.array(src, dtype=np.int32)


def self_distillation_loss(
    student: nn.Module,
    teacher: nn.Module,
    real: list[int],
    gen_start: int,
    layout: RegionLayout,
    mask_id: int,
    vocab: int,
    ntp_term: bool = True,
    forcing: str = "student",
) -> tuple[mx.array, mx.array]:
    """Hard-teacher self-distillation loss of one sequence (see the module docstring).

    Args:
        student, teacher: models with positional RoPE; the teacher is frozen.
        real: prompt + teacher continuation token ids.
        gen_start: index of the first continuation token.
        layout: the mask regions.
        mask_id: the mask token id.
        vocab: number of output logits that may be emitted (the mask column,
            if any, is excluded).
        ntp_term: add the next-token term at the real continuation positions
            (pointless for a gated student, whose real positions are the teacher's).
        forcing: ``"student"`` (the paper's objective): the teacher scores the
            student's own block, and its argmax after the student's drafts is
            the target. ``"teacher"``: the target of the slot at position q is
            the teacher's greedy continuation token at q + 1 (slots past the
            continuation's end are left out); no teacher forward pass. Student
            forcing can settle into a fixed point where the student drafts a
            filler token and the teacher, given those drafts, predicts it again;
            teacher forcing cannot.

    Returns:
        (loss, mtp_accuracy): scalar loss and the share of mask predictions
        equal to their target.

    Raises:
        InvalidArgumentError: unknown ``forcing``.
    """
    if forcing not in FORCINGS:
        raise InvalidArgumentError(
            f"forcing must be one of {', '.join(FORCINGS)}, not {forcing!r}."
        )
    ids = mx.array(real + [mask_id] * layout.n_slots)
    s_logits = forward_layout(student, ids, layout)[:, :vocab].astype(mx.float32)
    slots = np.arange(layout.n_real, layout.n_real + layout.n_slots)
    if forcing == "teacher":
        nxt = layout.positions[slots].astype(np.int64) + 1
        keep = nxt < layout.n_real
        slot_rows = mx.array(slots[keep])
        slot_targets = mx.array(np.asarray(real, dtype=np.int32)[nxt[keep]])
        targets = mx.array(real[1:] + [0])  # row i's target at real rows: token i + 1
    else:
        _, draft_src = region_rows(layout)
        drafts = mx.stop_gradient(mx.argmax(s_logits[mx.array(draft_src)], axis=-1))
        t_ids = mx.concatenate([mx.array(real), drafts.astype(mx.int32)])
        t_logits = mx.stop_gradient(forward_layout(teacher, t_ids, layout)[:, :vocab])
        targets = mx.argmax(t_logits, axis=-1)
        # slot s (position p+s, draft d_s in the teacher's input) predicts the token at
        # p+s+1; its target is the teacher's argmax at that same slot
        slot_rows = mx.array(slots)
        slot_targets = targets[slot_rows]
    if slot_rows.size:
        mtp = nn.losses.cross_entropy(s_logits[slot_rows], slot_targets, reduction="mean")
        acc = mx.mean(mx.argmax(s_logits[slot_rows], axis=-1) == slot_targets)
    else:  # every slot lies past the continuation's end (a continuation of one token)
        mtp = mx.sum(s_logits[:1]) * 0.0
        acc = mx.array(0.0)
    if not ntp_term:
        return mtp, acc
    ntp_rows = mx.array(np.arange(gen_start - 1, layout.n_real - 1))
    ntp = nn.losses.cross_entropy(s_logits[ntp_rows], targets[ntp_rows], reduction="mean")
    return mtp + ntp, acc


# ------------------------------------------------------------ model setup
def add_mask_token(model: nn.Module, tokenizer: Any) -> tuple[int, mx.array]:
    """Choose the mask token's id and its initial embedding row.

    The id is the tokenizer's ``<|mtp_special_token_0|>`` if it has one, else
    the first unused embedding row (a padded vocabulary), else a new row past
    the end. The row starts as the mean input embedding.

    Returns:
        (mask_token_id, row (D,) float32).
    """
    w = _dense_embedding(model.model.embed_tokens)
    rows = int(w.shape[0])
    tok_id = tokenizer_mask_id(tokenizer)
    if tok_id is not None:
        return int(tok_id), w[min(tok_id, rows - 1)].astype(mx.float32)
    n_vocab = len(tokenizer.get_vocab())
    if n_vocab > rows:
        raise InvalidArgumentError(
            f"the tokenizer has {n_vocab} tokens but the embedding only {rows} rows; this "
            "vocabulary layout is not supported."
        )
    mid = n_vocab  # first unused (padding) row, or a new row at the end
    row = mx.mean(w.astype(mx.float32), axis=0)
    return int(mid), row


def _dense_embedding(emb: nn.Module) -> mx.array:
    return dense_weight(emb)


def resize_for_mask(model: nn.Module, mask_id: int, row: mx.array) -> None:
    """Put the mask token's row into a (dense) model's embedding, appending a
    row if ``mask_id`` is past the end; an untied LM head gets a matching row
    (the mean of its rows). ``args.vocab_size`` follows. Modifies ``model``."""
    emb = model.model.embed_tokens
    w = emb.weight
    if mask_id >= w.shape[0]:
        w = mx.concatenate([w, row.astype(w.dtype)[None]])
        head = getattr(model, "lm_head", None)
        if head is not None and not getattr(model.args, "tie_word_embeddings", False):
            hw = head.weight
            head.weight = mx.concatenate([hw, mx.mean(hw, axis=0, keepdims=True)])
        model.args.vocab_size = int(w.shape[0])
    else:
        w = mx.concatenate([w[:mask_id], row.astype(w.dtype)[None], w[mask_id + 1 :]])
    emb.weight = w


# --------------------------------------------------------------- training
def checkpoint_dir(out: str | Path) -> Path:
    """The checkpoint folder of a run that writes ``out`` (``out/../.<name>.ckpt``);
    a run with ``resume`` continues from the one there."""
    out = Path(out)
    return out.parent / f".{out.name}.ckpt"


class Trainer:
    """Self-distillation of one loaded model (see the module docstring).

    Args:
        loaded: the base model (:class:`~mlx_mtp.loading.LoadedModel`): float32,
            bfloat16, or quantized as stored for LoRA (QLoRA: mlx-lm's LoRA
            layers over the frozen quantized linears, Dettmers et al., *QLoRA*,
            arXiv 2305.14314, §3); full fine-tuning needs float weights.
        prompts: training prompts (text).
        out: output folder (adapter in LoRA mode, model folder otherwise).
        config: :class:`TrainConfig`.
        prompt_format: ``"chat"`` or ``"plain"``.
    """

    def __init__(
        self,
        loaded: Any,
        prompts: list[str],
        out: Path,
        config: TrainConfig,
        prompt_format: str = "chat",
    ):
        if config.k_min < 2 or config.k_max < config.k_min:
            raise InvalidArgumentError(
                f"k range [{config.k_min}, {config.k_max}] is invalid; k_min must be >= 2."
            )
        self.loaded, self.prompts, self.out, self.cfg = loaded, prompts, Path(out), config
        self.prompt_format = prompt_format
        self.tokenizer = loaded.tokenizer
        self.teacher = loaded.model
        self.quantized = any(hasattr(m, "scales") for _, m in self.teacher.named_modules())
        if self.quantized and not config.lora:
            raise InvalidArgumentError(
                "full fine-tuning (--full) needs float weights and this model is quantized; "
                "use --lora (QLoRA on the quantized weights) or load it with --dtype float32."
            )
        self.fingerprint = model_fingerprint(self.teacher)
        self.gen_model = clone_modules(self.teacher)  # plain RoPE for batched generation
        install_positional_rope(self.teacher)
        self.teacher.freeze()
        self.eos = set(tokenizer_eos_ids(self.tokenizer))
        self.mask_id, row = add_mask_token(self.teacher, self.tokenizer)
        self.vocab = int(self.teacher.model.embed_tokens.weight.shape[0])
        mx.random.seed(config.seed)  # the LoRA init below draws random numbers
        self.student = self._make_student(row)
        self.opt = optim.AdamW(learning_rate=self._schedule(), weight_decay=0.0)
        self.step = 0
        self._conts = Continuations(
            self.gen_model,
            [self._prompt_ids(i) for i in range(len(prompts))],
            config.gen_tokens,
            self.eos,
            batch_size=GEN_BATCH,
            path=self.ckpt_dir().with_name(self.ckpt_dir().name + ".continuations.jsonl"),
            meta={"model_fingerprint": self.fingerprint, "prompt_format": prompt_format},
            progress=False,
            own_file=True,  # a file of an older version is decoded again
        )

    # ------------------------------------------------------------ student
    def _make_student(self, row: mx.array) -> nn.Module:
        cfg = self.cfg
        if cfg.lora:
            student = clone_modules(self.teacher)
            student.freeze()
            self.lora_paths = lora_modules(student, LORA_KEYS, cfg.lora_layers)
            gate = MaskGate() if cfg.gated else None
            if gate is not None:
                layers = gated_lora_layers(student, self.lora_paths, gate, cfg.rank, cfg.scale)
                student.update_modules(tree_unflatten(layers))
            else:
                linear_to_lora_layers(
                    student,
                    min(cfg.lora_layers, len(student.layers)),
                    {"rank": cfg.rank, "scale": cfg.scale, "dropout": 0.0, "keys": LORA_KEYS},
                )
            student.model.embed_tokens = MaskedEmbedding(
                student.model.embed_tokens, self.mask_id, row, gate
            )
            student.model.embed_tokens.freeze()
            student.model.embed_tokens.unfreeze(keys=["mask_embedding"], recurse=False)
        else:
            student = _deep_copy_model(self.teacher)
            student.unfreeze()
            resize_for_mask(student, self.mask_id, row)
        mx.eval(student.parameters())
        return student

    def _schedule(self):
        lr, warm = self.cfg.peak_lr, max(self.cfg.warmup, 1)
        decay = max(self.cfg.steps - warm, 1)
        return optim.join_schedules(
            [optim.linear_schedule(lr * 0.01, lr, warm), optim.cosine_decay(lr, decay, lr * 0.1)],
            [warm],
        )

    def trainable(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.student.trainable_parameters()))

    # ------------------------------------------------------------ one step
    def order(self) -> np.ndarray:
        """The order in which prompts are used (a permutation fixed by the seed)."""
        return np.random.default_rng([self.cfg.seed, 7]).permutation(len(self.prompts))

    def continuation(self, step: int) -> tuple[list[int], list[int]]:
        """Prompt ids and the teacher's greedy continuation for ``step``.

        Continuations are generated :data:`GEN_BATCH` prompts at a time (this
        step's and the next ones in :meth:`order`) and kept next to the
        checkpoint folder (:class:`~mlx_mtp.training.continuations.Continuations`),
        so a resumed run does not generate them again.
        """
        order = self.order()
        pos = step // max(self.cfg.reuse, 1)
        idx = int(order[pos % len(order)])
        if idx not in self._conts.done:
            b0 = (pos // GEN_BATCH) * GEN_BATCH
            self._conts.get([int(order[(b0 + i) % len(order)]) for i in range(GEN_BATCH)])
        seq = self._conts.get([idx])[0]
        return seq.prompt, seq.generated

    def _prompt_ids(self, i: int) -> list[int]:
        ids = encode_prompt(self.tokenizer, self.prompts[i], self.prompt_format)
        return ids[-self.cfg.max_prompt_tokens :]

    def sample(self, step: int) -> tuple[list[int], int, RegionLayout]:
        """The sequence and mask regions of ``step`` (deterministic in seed and step)."""
        rng = np.random.default_rng([self.cfg.seed, step])
        prompt, cont = self.continuation(step)
        real = prompt + cont
        gen_start = len(prompt)
        lo, hi = gen_start - 1, len(real) - 2
        n_reg = min(self.cfg.regions, hi - lo + 1)
        anchors = sorted(rng.choice(np.arange(lo, hi + 1), size=n_reg, replace=False).tolist())
        ks = rng.integers(self.cfg.k_min, self.cfg.k_max + 1, size=n_reg).tolist()
        return real, gen_start, region_layout(len(real), anchors, ks)

    def train_step(self) -> dict[str, float]:
        real, gen_start, layout = self.sample(self.step)

        def loss_fn(model):
            return self_distillation_loss(
                model,
                self.teacher,
                real,
                gen_start,
                layout,
                self.mask_id,
                self.vocab,
                ntp_term=not (self.cfg.lora and self.cfg.gated),
                forcing=self.cfg.forcing,
            )

        (loss, acc), grads = nn.value_and_grad(self.student, loss_fn)(self.student)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        self.opt.update(self.student, grads)
        mx.eval(self.student.trainable_parameters(), self.opt.state, loss, acc)
        self.step += 1
        return {"loss": float(loss.item()), "mtp_acc": float(acc.item()), "tokens": len(real)}

    # --------------------------------------------------------- checkpoints
    def ckpt_dir(self) -> Path:
        """The checkpoint folder of this run (:func:`checkpoint_dir`)."""
        return checkpoint_dir(self.out)

    def save_checkpoint(self) -> None:
        """Trainable weights, optimizer state and the step, written atomically."""
        with atomic_folder(self.ckpt_dir()) as tmp:
            mx.save_safetensors(str(tmp / "trainable.safetensors"), self.trainable())
            state = dict(tree_flatten(self.opt.state))
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), state)
            info = {"step": self.step, "config": asdict(self.cfg), "fingerprint": self.fingerprint}
            (tmp / "state.json").write_text(json.dumps(info, indent=2))

    def resume(self) -> bool:
        """Load the checkpoint if there is one for the same model and settings.

        Raises:
            InvalidArgumentError: a checkpoint of another model or other settings.
        """
        d = self.ckpt_dir()
        if not (d / "state.json").is_file():
            return False
        info = json.loads((d / "state.json").read_text())
        # checkpoints from before these settings existed used their old behaviour
        saved = {"gated": False, "forcing": "student", **(info.get("config") or {})}
        now = asdict(self.cfg)
        if info.get("fingerprint") != self.fingerprint:
            raise InvalidArgumentError(
                f"The checkpoint in {d} was made for another model; delete it or use "
                "--no-resume to start over."
            )
        if saved != now:
            diff = ", ".join(
                f"{k}: {saved.get(k)!r} there, {now.get(k)!r} now"
                for k in sorted(set(saved) | set(now))
                if saved.get(k) != now.get(k)
            )
            raise InvalidArgumentError(
                f"The checkpoint in {d} was made with other settings ({diff}); use the same "
                "settings, delete it, or use --no-resume to start over."
            )
        w = mx.load(str(d / "trainable.safetensors"))
        self.student.update(tree_unflatten(list(w.items())))
        st = mx.load(str(d / "optimizer.safetensors"))
        self.opt.init(self.trainable())
        self.opt.state = tree_unflatten(list(st.items()))
        self.step = int(info["step"])
        return True

    # ----------------------------------------------------------------- run
    def run(self, resume: bool = True, log: Any = None, stop_after: int | None = None) -> Path:
        """Train to ``config.steps`` with a progress bar, checkpoints and resume,
        then write the output folder (atomically) and return it.

        ``stop_after`` ends the run early at that step of the same schedule (the
        checkpoint stays, so a later run with ``resume`` continues to the end)."""
        mx.random.seed(self.cfg.seed)
        if resume and self.resume():
            msg = f"resumed at step {self.step}"
            print(msg) if log is None else log(msg)
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train mtp", unit="step")
        ema = None
        t0 = time.perf_counter()
        end = self.cfg.steps if stop_after is None else min(stop_after, self.cfg.steps)
        while self.step < end:
            m = self.train_step()
            ema = m if ema is None else {k: 0.9 * ema[k] + 0.1 * m[k] for k in m}
            bar.set_postfix(loss=f"{ema['loss']:.3f}", mtp_acc=f"{ema['mtp_acc']:.2f}")
            bar.update(1)
            if log is not None:
                log(
                    f"step {self.step} loss {m['loss']:.4f} mtp_acc {m['mtp_acc']:.3f} "
                    f"tokens {m['tokens']} elapsed {time.perf_counter() - t0:.0f}s"
                )
            if self.step % self.cfg.save_every == 0 or self.step == end:
                self.save_checkpoint()
        bar.close()
        return self.export()

    def export(self) -> Path:
        """Write the result to ``out`` (:func:`~mlx_mtp.artifacts.atomic_folder`)."""
        with atomic_folder(self.out) as tmp:
            (self._export_adapter if self.cfg.lora else self._export_model)(tmp)
        return self.out

    def _export_adapter(self, d: Path) -> None:
        weights: dict[str, mx.array] = {}
        for path in self.lora_paths:
            m = get_module(self.student, path)
            weights[f"{path}.lora_a"] = m.lora_a.astype(mx.float16)
            weights[f"{path}.lora_b"] = m.lora_b.astype(mx.float16)
        weights["mask_embedding"] = self.student.model.embed_tokens.mask_embedding.astype(
            mx.float32
        )
        mx.save_safetensors(str(d / ADAPTER_WEIGHTS), weights)
        cfg = {
            "format": "mlx-mtp-confadapt-adapter",
            "version": 1,
            "base_model": self.loaded.name,
            "base_fingerprint": self.fingerprint,
            "base_signature": model_signature(self.teacher),
            "mask_token": MASK_TOKEN,
            "mask_token_id": self.mask_id,
            "eos_token_ids": sorted(self.eos),
            "prompt_format": self.prompt_format,
            "k": 16,
            "lora": {
                "rank": self.cfg.rank,
                "scale": self.cfg.scale,
                "keys": LORA_KEYS,
                "modules": self.lora_paths,
                "gated": self.cfg.gated,
            },
            "training": {**asdict(self.cfg), "steps_done": self.step, "prompts": len(self.prompts)},
        }
        (d / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")

    def _export_model(self, d: Path) -> None:
        student = self.student
        save_model(d, student, donate_model=False)
        config = dict(self.loaded.config)
        config["vocab_size"] = int(student.model.embed_tokens.weight.shape[0])
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        save_config(config, config_path=d / "config.json")
        tok = self.tokenizer._tokenizer
        if tokenizer_mask_id(tok) is None:
            tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
        tok.save_pretrained(str(d))
        got = tokenizer_mask_id(tok)
        if got != self.mask_id:
            raise InvalidArgumentError(
                f"the tokenizer gave {MASK_TOKEN} id {got} but the embedding row is "
                f"{self.mask_id}; this model's vocabulary layout is not supported for full "
                "fine-tuning, use --lora."
            )
        meta = MTPMetadata(
            self.mask_id,
            sorted(self.eos),
            self.prompt_format,
            16,
            source=f"mlx-mtp train mtp on {self.loaded.name}",
        )
        write_metadata(d, meta)


def _deep_copy_model(model: nn.Module) -> nn.Module:
    c = clone_modules(model)
    c.update(tree_unflatten([(k, mx.array(v)) for k, v in tree_flatten(model.parameters())]))
    return c
