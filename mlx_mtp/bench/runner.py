"""Run methods side by side over Spec-Bench or GSM8K, resumable.

One process, one loaded model shared by every method (each method gets its own
:class:`~mlx_mtp.api.MTPModel`, i.e. its own engine and KV cache). After one
warm-up generation per method, methods run interleaved prompt by prompt: for
each prompt (and turn, and repeat) every method in turn, ``ntp`` first, with
the engine's cache reset before each generation so no method reuses another's
prefill. With ``--interleave`` the methods of one prompt run at once, one
decoding step of each in turn (:func:`_run_interleaved`). Every finished
generation is appended to ``records.jsonl`` in the output folder; a rerun with
the same settings skips the (prompt, turn, repeat, method) entries found there
and recomputes the aggregates.
"""

from __future__ import annotations

import json
import os
import platform
import time
import zlib
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from .. import _blas, distributed
from ..api import Result
from ..artifacts import check_destination, check_writable
from ..data import DATA_SETS, TASKS, data_set_path, load_questions, render_prompt
from ..decoding import _synchronize_streams
from ..errors import InvalidArgumentError
from ..loading import DTYPES, load_model, resolve_model, share_target
from ..methods import make_method
from . import metrics
from .config import DEFAULT_GSM8K, BenchConfig
from .peer import PEER_DRAFT_NAME, PEER_NAME, PEER_NAMES, MLXLMPeer
from .plots import PLOT_FILES
from .profiles import profile_curve
from .report import build_results, build_sweep, write_outputs, write_sweep
from .simulate import SimulatedClock, device_spec, simulating

RECORDS = "records.jsonl"
SETTINGS = "settings.json"
RESULTS = "results.json"
REPORT = "report.md"
GSM8K_INSTRUCTION = "\nSolve the problem step by step and end with the final numeric answer."


@dataclass
class BenchPrompt:
    """One benchmark question: ``turns`` are user messages; ``answer`` is the
    GSM8K reference solution (None for Spec-Bench)."""

    qid: str
    task: str
    category: str
    turns: list[str]
    answer: str | None = None


# ------------------------------------------------------------------ prompts
def select_prompts(config: BenchConfig) -> tuple[list[BenchPrompt], list[str]]:
    """The prompts of a run, round-robin over categories, and the category order.

    Raises:
        InvalidArgumentError: missing question file, unknown category, no prompt.
    """
    if config.mode == "gsm8k":
        return _gsm8k_prompts(config), ["gsm8k"]
    path = config.questions
    try:
        qs = load_questions(path)
    except FileNotFoundError:
        raise InvalidArgumentError(f"--questions {path}: no such file.") from None
    except ValueError as e:
        raise InvalidArgumentError(f"--questions: {e}") from None
    if config.categories:
        groups = list(dict.fromkeys(config.categories))
        known = {q["task"] for q in qs} | {q.get("category", "") for q in qs}
        bad = [g for g in groups if g not in known]
        if bad:
            raise InvalidArgumentError(
                f"--categories: unknown {', '.join(bad)}; the questions have tasks/categories "
                f"{', '.join(sorted(k for k in known if k))}."
            )
        member = {g: [q for q in qs if g in (q["task"], q.get("category"))] for g in groups}
    else:
        present = [t for t in TASKS if any(q["task"] == t for q in qs)]
        extra = sorted({q["task"] for q in qs} - set(TASKS))
        groups = present + extra
        member = {g: [q for q in qs if q["task"] == g] for g in groups}
    if config.limit:
        member = {g: v[: config.limit] for g, v in member.items()}
    out: list[BenchPrompt] = []
    seen: set[str] = set()
    for i in range(max((len(v) for v in member.values()), default=0)):
        for g in groups:
            if i < len(member[g]):
                q = member[g][i]
                qid = str(q.get("question_id", f"{g}-{i}"))
                if qid in seen:
                    continue
                seen.add(qid)
                out.append(BenchPrompt(qid, g, q.get("category", g), list(q["turns"])))
    if not out:
        raise InvalidArgumentError("No prompts selected; check --categories and --questions.")
    return out, groups


def _gsm8k_prompts(config: BenchConfig) -> list[BenchPrompt]:
    path = Path(config.gsm8k) if config.gsm8k else data_set_path(DEFAULT_GSM8K)
    if path is None:
        raise InvalidArgumentError(
            "--mode gsm8k: GSM8K is not shipped with mlx-mtp; pass --gsm8k PATH (a jsonl with "
            "'question' and 'answer' fields), or set MLX_MTP_DATA to the folder that holds "
            f"{DATA_SETS[DEFAULT_GSM8K]}."
        )
    if not path.is_file():
        raise InvalidArgumentError(
            f"GSM8K file {path} not found; pass --gsm8k PATH to a jsonl with 'question' and "
            "'answer' fields (the answer's number after '####')."
        )
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                if not (isinstance(q["question"], str) and isinstance(q["answer"], str)):
                    raise TypeError("'question' and 'answer' must be strings")
                out.append(
                    BenchPrompt(f"gsm8k-{i}", "gsm8k", "gsm8k", [q["question"]], q["answer"])
                )
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InvalidArgumentError(f"{path}:{i + 1}: not a GSM8K record ({e})") from e
            if config.limit and len(out) >= config.limit:
                break
    if not out:
        raise InvalidArgumentError(f"{path} holds no GSM8K questions.")
    return out


def recorded_outputs(
    out: str | Path, tokenizer: Any, method: str = "ntp"
) -> list[tuple[list[int], list[int], dict[str, Any]]]:
    """The first-turn Spec-Bench generations of ``method`` in a bench folder.

    Lets analyses (head accuracy, mask hit rates) reuse a run's greedy outputs
    instead of decoding again.

    Args:
        out: an ``mlx-mtp bench --out`` folder (finished or partial).
        tokenizer: the tokenizer of the benchmarked model (rebuilds the prompt ids).
        method: the method label as recorded (default the ``ntp`` reference).

    Returns:
        ``(prompt ids, generated ids, record)`` per generation, in file order
        (read as :meth:`ResultStore.load` reads: a half-written last record is
        skipped, a rerun entry counts once).

    Raises:
        InvalidArgumentError: the folder has no ``records.jsonl``.
    """
    records = read_records(out)
    questions = {str(q["question_id"]): q for q in load_questions()}
    rows = []
    for r in records:
        if r["method"] != method or r["turn"] != 1 or str(r["qid"]) not in questions:
            continue
        msgs = [{"role": "user", "content": questions[str(r["qid"])]["turns"][0]}]
        rows.append((render_prompt(tokenizer, msgs), list(r["tokens"]), r))
    return rows


def read_records(out: str | Path) -> list[dict[str, Any]]:
    """The per-generation records of an ``mlx-mtp bench --out`` folder, read
    as :meth:`ResultStore.load` reads them (a half-written last record is
    skipped, a rerun entry counts once) without changing the folder.

    Raises:
        InvalidArgumentError: the folder has no ``records.jsonl``.
    """
    path = Path(out) / RECORDS
    if not path.exists():
        raise InvalidArgumentError(f"{path} does not exist: pass an `mlx-mtp bench --out` folder")
    return _read_records(path)[0]


# ------------------------------------------------------------------ storage
class ResultStore:
    """The per-generation records of one output folder (``records.jsonl``) and
    the settings they were made with (``settings.json``).

    Raises:
        InvalidArgumentError: the folder holds a run with other settings and
            ``overwrite`` is false.
    """

    def __init__(self, out: Path, settings: dict[str, Any], overwrite: bool = False):
        self.out = out
        self.path = out / RECORDS
        out.mkdir(parents=True, exist_ok=True)
        spath = out / SETTINGS
        old = json.loads(spath.read_text()) if spath.is_file() else None
        if old != settings and (old is not None or self.path.exists()):
            if not overwrite:
                keys = set(settings) | set(old or {})
                diff = sorted(k for k in keys if (old or {}).get(k) != settings.get(k))
                raise InvalidArgumentError(
                    f"{out} holds a benchmark run with different settings "
                    f"(differs in: {', '.join(diff) or 'unknown'}). Use another --out, or "
                    "--overwrite to discard it."
                )
        if old != settings or overwrite:
            for name in (RECORDS, RESULTS, REPORT, *PLOT_FILES):
                (out / name).unlink(missing_ok=True)
        spath.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    def load(self, repair: bool = True) -> list[dict[str, Any]]:
        """All complete records, one per entry. With ``repair``, a half-written record (an
        interrupted run) is also cut off the file so that appends stay valid;
        without it (reading while another process may be writing) the file is
        left alone."""
        records, keep, total = _read_records(self.path)
        if repair and len(keep) != total:
            self.path.write_text("".join(keep), encoding="utf-8")
        return records

    def append(self, record: dict[str, Any]) -> None:
        """Write one record and flush it to disk."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _read_records(path: Path) -> tuple[list[dict[str, Any]], list[str], int]:
    """(records, complete lines, number of lines) of a ``records.jsonl``: a
    half-written last line is skipped; one record per (prompt, turn, repeat,
    method), the last one written wins."""
    if not path.exists():
        return [], [], 0
    good, lines = [], path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
            if not line.endswith("\n"):
                raise ValueError("no newline")
        except ValueError:
            continue
        good.append(rec)
        keep.append(line)
    unique = {entry_key(r["qid"], r["turn"], r["repeat"], r["method"]): r for r in good}
    return list(unique.values()), keep, len(lines)


def entry_key(qid: str, turn: int, repeat: int, method: str) -> tuple[str, int, int, str]:
    """Identity of one generation in ``records.jsonl``."""
    return (str(qid), int(turn), int(repeat), method)


# ------------------------------------------------------------------ running
def run_bench(
    config: BenchConfig,
    loaded: Any = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
    plots: bool = True,
    generate: bool = True,
    pipeline: bool = False,
) -> dict[str, Any]:
    """Run (or resume) a benchmark and write ``results.json``, ``report.md``
    and the plots into ``config.out``.

    Args:
        config: the settings.
        loaded: an already loaded :class:`~mlx_mtp.loading.LoadedModel` (tests,
            notebooks); None loads ``config.model`` with ``config.dtype``.
        overwrite: discard a run with other settings in the same folder, or
            write into a folder that holds no benchmark run but other files
            (refused otherwise).
        progress: show a tqdm progress bar.
        plots: write the PNG plots.
        generate: False only rebuilds the outputs from the records found in
            ``config.out`` (a partial run gives partial tables, marked so).
        pipeline: on several ranks (``mlx.launch``), shard by layers. Rank 0
            plans the run, keeps the records and writes the outputs; the other
            ranks run the same generations and return ``{}``.

    Returns:
        The results dict written to ``results.json``.

    Raises:
        InvalidArgumentError: bad settings, or a folder with another run or
            with files of its own (without ``overwrite``).
        UnknownMethodError, UnsupportedModelError, ModelNotFoundError, ...
    """
    config.validate()
    # the engines made inside run on the simulated device of config.device,
    # else of MLX_MTP_SIMULATE_DEVICE where it is set
    with simulating(config.device) as sim:
        return _run_bench(config, loaded, sim, overwrite, progress, plots, generate, pipeline)


def run_sweep(
    config: BenchConfig,
    profiles: list[str],
    ms_per_token: float = 12.0,
    loaded: Any = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
    plots: bool = True,
    generate: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the benchmark of ``config`` once per device profile,
    the model loaded once, and write the sweep's ``results.json`` and
    ``report.md`` (every method's speedup and tau per profile) into
    ``config.out``.

    Each profile is a whole benchmark on its own simulated device
    (``profile=NAME,ms_per_token=MS``, :mod:`mlx_mtp.bench.profiles`) in the
    subfolder ``config.out/NAME``, with its own records, report and plots:
    it resumes, and rebuilds with ``generate=False``, as :func:`run_bench`.

    Args:
        config: the settings (``config.device`` is set per profile).
        profiles: profile names, in table order.
        ms_per_token: the simulated one-token pass, in milliseconds.
        loaded: an already loaded model (None: ``config.model`` is loaded
            once, before the first profile).
        overwrite, progress, plots, generate: as for :func:`run_bench`.

    Returns:
        The sweep's results dict (schema: docs/benchmarks.md).

    Raises:
        InvalidArgumentError: an unknown profile (the message lists the known
            ones), a sweep under ``mlx.launch``, a folder with another run.
    """
    config.validate()
    if not profiles:
        raise InvalidArgumentError("--profiles is empty; give e.g. 'bf16-flat,m4pro-4bit'.")
    for name in profiles:
        try:
            profile_curve(name)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"--profiles: {e}") from None
    if len(set(profiles)) != len(profiles):
        raise InvalidArgumentError(f"--profiles lists a profile twice: {','.join(profiles)}")
    if not 0 < ms_per_token < 60000:
        raise InvalidArgumentError(f"--ms-per-token must be > 0, got {ms_per_token:g}")
    if distributed.size() > 1:
        raise InvalidArgumentError(
            "--profiles runs on one process; drop it for a sharded (mlx.launch) benchmark."
        )
    out = Path(config.out)
    if (out / RECORDS).exists() or (out / SETTINGS).exists():
        raise InvalidArgumentError(
            f"{out} holds a single benchmark run, not a --profiles sweep: use another --out."
        )
    runs = []
    for name in profiles:
        sub = replace(config, device=device_spec(name, ms_per_token), out=str(out / name))
        if generate and loaded is None:
            if config.dtype is not None and config.dtype not in (*DTYPES, "auto"):
                raise InvalidArgumentError(
                    f"Unknown dtype {config.dtype!r}; use one of float32, bfloat16, float16, auto."
                )
            loaded = load_model(config.model, config.dtype)
        res = run_bench(
            sub, loaded, overwrite=overwrite, progress=progress, plots=plots, generate=generate
        )
        runs.append((name, profile_curve(name), res))
    sweep = build_sweep(config, ms_per_token, runs)
    write_sweep(sweep, out)
    return sweep


def _run_bench(
    config: BenchConfig,
    loaded: Any,
    sim: Any,
    overwrite: bool,
    progress: bool,
    plots: bool,
    generate: bool,
    pipeline: bool,
) -> dict[str, Any]:
    if sim is not None and any(s.name in PEER_NAMES for s in config.methods):
        raise InvalidArgumentError(
            f"the {PEER_NAME} row runs mlx-lm's own loop on this machine, not on the simulated "
            "device (MLX_MTP_SIMULATE_DEVICE or --profiles): drop it from --methods, or run "
            "without a simulated device."
        )
    if config.interleave and distributed.size() > 1:
        raise InvalidArgumentError(
            "--interleave runs on one process; drop it for a sharded (mlx.launch) benchmark."
        )
    methods = {s.label: _make(s, config) for s in config.methods}
    prompts, groups = select_prompts(config)
    out = Path(config.out)
    if generate:  # a file or a read-only folder, before the model is imported or loaded
        check_writable(out, "--out")
        # a folder of other files: its results.json or report.md would be replaced
        ours = (out / SETTINGS).is_file() or (out / RECORDS).is_file()
        check_destination(out, overwrite, "--out", ours=ours)
    if not generate and not (out / RECORDS).exists():
        raise InvalidArgumentError(f"{out} holds no finished generations to report on.")
    if generate and loaded is None:
        # a bad model spec or dtype fails here, before the output folder is made

        if config.dtype is not None and config.dtype not in (*DTYPES, "auto"):
            raise InvalidArgumentError(
                f"Unknown dtype {config.dtype!r}; use one of float32, bfloat16, float16, auto."
            )
        distributed.on_main(lambda: str(resolve_model(config.model)))  # imports once
    stores: list[ResultStore] = []

    def plan() -> tuple[dict, list, int]:
        # rank 0 only (see distributed.on_main): it alone keeps the records
        stores.append(ResultStore(out, config.settings(), overwrite))
        done = {
            entry_key(r["qid"], r["turn"], r["repeat"], r["method"]): r
            for r in stores[0].load(repair=generate)
        }
        todo, planned = [], 0
        for p in prompts:
            for turn in range(1, min(config.turns, len(p.turns)) + 1):
                for rep in range(config.repeats):
                    for label in methods:
                        planned += 1
                        if entry_key(p.qid, turn, rep, label) not in done:
                            todo.append((p, turn, rep, label))
        return done, todo, planned

    done, todo, planned = distributed.on_main(plan)
    store = stores[0] if stores else None

    if todo and generate:
        if loaded is None:
            loaded = load_model(config.model, config.dtype, pipeline=pipeline)
        # a draft model that is the target itself drafts with its weights, loaded once
        methods = {s.label: _make(s, config, loaded) for s in config.methods}
        models = {
            label: m.bind(loaded)
            if isinstance(m, MLXLMPeer)
            else loaded.bind(m, runner=config.runner)
            for label, m in methods.items()
        }
        _warm_up(models, loaded.tokenizer)
        tok = loaded.tokenizer
        bar = _progress(len(todo), progress)
        try:
            for p, turn, rep, labels in _groups(todo, config.interleave):
                bar.set_postfix_str(f"{p.task} {' '.join(labels)}", refresh=False)
                if config.interleave:
                    recs = _run_interleaved(config, models, labels, p, turn, rep, done, tok)
                else:
                    recs = {
                        labels[0]: _run_one(
                            config, models[labels[0]], labels[0], p, turn, rep, done, tok
                        )
                    }
                for label in labels:
                    if store is not None:
                        store.append(recs[label])
                    done[entry_key(p.qid, turn, rep, label)] = recs[label]
                bar.update(len(labels))
        finally:
            bar.close()

    if store is None:  # not rank 0
        return {}
    records = store.load(repair=generate)
    if not records:
        raise InvalidArgumentError(f"{out} holds no finished generations to report on yet.")
    results = build_results(config, methods, records, groups, _environment(config.device))
    results["progress"] = {"generations": len(records), "planned": planned}
    write_outputs(results, out, plots=plots)
    return results


def _progress(total: int, enabled: bool) -> Any:
    return tqdm(total=total, desc="bench", unit="gen", disable=not enabled, dynamic_ncols=True)


def _warm_up(models: dict[str, Any], tokenizer: Any) -> None:
    """One short untimed generation per method (compiles kernels, fills caches)."""
    ids = render_prompt(tokenizer, [{"role": "user", "content": "Say hello in three words."}])
    for m in models.values():
        _reset(m)
        m.generate(ids, max_tokens=8)
        _reset(m)


def _reset(m: Any) -> None:
    """Drop a benchmarked model's KV cache (an MTPModel's engine, or the peer's nothing)."""
    if isinstance(m, MLXLMPeer):
        m.reset()
    else:
        m.engine.reset()


def _groups(
    todo: list[tuple[BenchPrompt, int, int, str]], interleave: bool
) -> list[tuple[BenchPrompt, int, int, list[str]]]:
    """The generations to run together: one per entry, or with ``interleave``
    all methods of one (prompt, turn, repeat) at once (in ``todo`` order)."""
    out: list[tuple[BenchPrompt, int, int, list[str]]] = []
    for p, turn, rep, label in todo:
        if interleave and out and (out[-1][0].qid, out[-1][1], out[-1][2]) == (p.qid, turn, rep):
            out[-1][3].append(label)
        else:
            out.append((p, turn, rep, [label]))
    return out


def _prompt_ids(
    config: BenchConfig, m: Any, p: BenchPrompt, turn: int, rep: int, done: dict, tokenizer: Any
) -> list[int]:
    """The token ids of one (prompt, turn) as ``m`` renders them."""
    messages = [{"role": "user", "content": p.turns[0]}]
    if config.mode == "gsm8k":
        messages = [{"role": "user", "content": p.turns[0] + GSM8K_INSTRUCTION}]
    if turn == 2:
        first = done[entry_key(p.qid, 1, rep, config.methods[0].label)]
        messages += [
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": p.turns[1]},
        ]
    # an MTPModel renders in its method's prompt format (a self-distilled MTP
    # checkpoint's "plain"); the mlx_lm peer with the chat template
    return render_prompt(tokenizer, messages) if isinstance(m, MLXLMPeer) else m.encode(messages)


def _seed(config: BenchConfig, p: BenchPrompt, turn: int, rep: int) -> int:
    return (config.seed + zlib.crc32(f"{p.qid}/{turn}/{rep}".encode())) % (2**31)


def _run_one(
    config: BenchConfig,
    m: Any,
    label: str,
    p: BenchPrompt,
    turn: int,
    rep: int,
    done: dict,
    tokenizer: Any,
) -> dict[str, Any]:
    ids = _prompt_ids(config, m, p, turn, rep, done, tokenizer)
    _reset(m)
    res = m.generate(
        ids, max_tokens=config.max_tokens, temp=config.temp, seed=_seed(config, p, turn, rep)
    )
    _reset(m)
    return _record(p, turn, rep, label, res)


def _run_interleaved(
    config: BenchConfig,
    models: dict[str, Any],
    labels: list[str],
    p: BenchPrompt,
    turn: int,
    rep: int,
    done: dict,
    tokenizer: Any,
) -> dict[str, dict[str, Any]]:
    """Generate one (prompt, turn, repeat) with every method in ``labels`` at once,
    one decoding step of each in turn (``--interleave``).

    A drift of the machine's speed (other tenants, clocks) then slows every
    method alike, where prompt-by-prompt interleaving leaves each method's
    generation of a prompt seconds apart. Each step is timed on its own and the
    device is synchronised before the next method's step starts, so no method's
    queued work runs in another's time; a method's decode time is the sum of
    its steps (the first one from the decoding loop's own clock, which starts
    after prefill). The device wait after a step counts as forward time. The
    mlx_lm peer runs its own loop and is generated alone, before the others.

    Returns:
        label -> record (as :func:`_run_one` writes it); peak memory there is
        that of all the methods' caches together.
    """
    recs: dict[str, dict[str, Any]] = {}
    live: dict[str, dict[str, Any]] = {}
    for label in labels:
        m = models[label]
        if isinstance(m, MLXLMPeer):
            recs[label] = _run_one(config, m, label, p, turn, rep, done, tokenizer)
            continue
        ids = _prompt_ids(config, m, p, turn, rep, done, tokenizer)
        _reset(m)
        it = m.stream_generate(
            ids, max_tokens=config.max_tokens, temp=config.temp, seed=_seed(config, p, turn, rep)
        )
        live[label] = {"it": it, "text": [], "tokens": [], "decode": 0.0, "wait": 0.0, "last": None}
    try:
        while live:
            for label in list(live):
                g = live[label]
                clock = models[label].engine.clock
                if isinstance(clock, SimulatedClock):
                    # each method's own virtual device and time line, stopped
                    # while the others run: a queued pass stays in flight, as
                    # in a run of this method alone
                    clock.resume()
                    t0 = clock.now()
                    chunk = next(g["it"])
                    t1 = t2 = clock.now()
                    clock.pause()
                else:
                    t0 = clock.now()
                    chunk = next(g["it"])
                    t1 = clock.now()
                    # the pass the step left queued is this method's time
                    _synchronize_streams()
                    clock.sync()
                    t2 = clock.now()
                    clock.outside += t2 - t1  # its planner counts it in the next step
                # the first call also prefills: take its decode part from the loop's clock
                g["decode"] += (
                    t2 - t0 if g["last"] is not None else chunk.stats.decode_time + t2 - t1
                )
                g["wait"] += t2 - t1
                g["text"].append(chunk.text)
                g["tokens"].extend(chunk.tokens)
                g["last"] = chunk
                if chunk.finish_reason is not None:
                    g["it"].close()  # the loop's cleanup (cache trim), untimed
                    _reset(models[label])
                    stats = replace(
                        chunk.stats,
                        decode_time=g["decode"],
                        forward_time=chunk.stats.forward_time + g["wait"],
                    )
                    res = Result("".join(g["text"]), g["tokens"], stats, chunk.finish_reason)
                    recs[label] = _record(p, turn, rep, label, res)
                    del live[label]
    finally:  # an interrupted group: close the rest (their loops trim the caches)
        for g in live.values():
            g["it"].close()
    return recs


def _record(p: BenchPrompt, turn: int, rep: int, label: str, res: Any) -> dict[str, Any]:
    """The ``records.jsonl`` entry of one finished generation."""
    s = res.stats
    rep_n, rep_total = metrics.repetition_counts(res.tokens)
    rec: dict[str, Any] = {
        "qid": p.qid,
        "task": p.task,
        "category": p.category,
        "turn": turn,
        "repeat": rep,
        "method": label,
        "prompt_tokens": s.prompt_tokens,
        "prefill_tokens": s.prefill_tokens,
        "prefill_time": s.prefill_time,
        "generated_tokens": s.generated_tokens,
        "forward_passes": s.forward_passes,
        "steps": s.steps,
        "plain_steps": s.plain_steps,
        "runner": s.runner,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "decode_time": s.decode_time,
        "forward_time": s.forward_time,
        "idle_time": s.idle_time,
        "slots": s.slots,
        "decode_tps": s.decode_tps,
        "tau": s.tau,
        "peak_memory_gb": s.peak_memory_gb,
        "finish_reason": res.finish_reason,
        "rep_repeated": rep_n,
        "rep_total": rep_total,
        "repetition_rate": rep_n / rep_total if rep_total else 0.0,
        "tokens": list(map(int, res.tokens)),
        "text": res.text,
        "time": time.time(),
    }
    if p.answer is not None:
        ok, pred, gold = metrics.gsm8k_correct(res.text, p.answer)
        rec.update(correct=ok, pred=pred, gold=gold)
    return rec


def _make(spec: Any, config: BenchConfig, target: Any = None) -> Any:
    """The method (or mlx-lm peer) of one ``--methods`` entry; ``draft`` and
    ``mlx_lm_draft`` rows that name no draft model get ``--draft-model``. With
    the loaded ``target``, a draft model that names it shares its weights
    (:func:`~mlx_mtp.loading.share_target`)."""
    opts = dict(spec.options)
    if spec.name in ("draft", PEER_DRAFT_NAME) and "draft_model" not in opts:
        if config.draft_model is not None:
            opts["draft_model"] = config.draft_model
    if target is not None:
        opts = share_target(target, opts)
    if spec.name in PEER_NAMES:
        return MLXLMPeer(spec.name, **opts)
    return make_method(spec.name, **opts)


def _environment(device: str | None = None) -> dict[str, Any]:
    try:
        mlx_ver, lm_ver = version("mlx"), version("mlx-lm")
    except Exception:  # pragma: no cover - metadata missing in odd installs
        mlx_ver = lm_ver = "unknown"
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mlx_ver,
        "mlx_lm": lm_ver,
        "device": str(mx.default_device()),
        "blas": _blas.blas_status(),
        "simulated_device": device or os.environ.get("MLX_MTP_SIMULATE_DEVICE") or None,
        "host_term": os.environ.get("MLX_MTP_HOST_TERM") != "0",
        "ranks": distributed.size(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
