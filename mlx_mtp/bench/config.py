"""Benchmark settings: the ``--methods`` mini-language and :class:`BenchConfig`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InvalidArgumentError
from ..runners import check_runner

#: the named data set ``--mode gsm8k`` reads without ``--gsm8k`` (found under
#: ``$MLX_MTP_DATA``, see :mod:`mlx_mtp.data`; GSM8K is not shipped)
DEFAULT_GSM8K = "gsm8k-test"


@dataclass(frozen=True)
class MethodSpec:
    """One method setting of a benchmark.

    Attributes:
        label: the setting as written, e.g. ``probe:bc=30,masks=2`` (unique).
        name: registry name (``ntp``, ``pld``, ``probe``, ``lookahead``, ...).
        options: keyword options passed to the method class (string values).
    """

    label: str
    name: str
    options: dict[str, str] = field(default_factory=dict)


def parse_methods(text: str, reference: str = "ntp") -> list[MethodSpec]:
    """Parse ``--methods``: methods separated by commas, each optionally followed
    by ``:key=value`` settings, more settings separated by commas too.

    ``"ntp,pld,probe:bc=30,masks=2,probe:bc=10"`` gives ntp, pld,
    ``probe:bc=30,masks=2`` and ``probe:bc=10``: a comma-separated token with
    ``=`` and no ``:`` belongs to the method before it. The reference method
    (``ntp``) is put first, added if missing.

    Raises:
        InvalidArgumentError: empty list, a setting before any method, a
            malformed ``key=value``, or the same setting listed twice.
    """
    specs: list[tuple[str, dict[str, str]]] = []
    for raw in text.split(","):
        tok = raw.strip()
        if not tok:
            continue
        if ":" in tok:
            name, _, first = tok.partition(":")
            name = name.strip()
            opts: dict[str, str] = {}
            if first.strip():
                _add_option(opts, first, name)
            specs.append((name, opts))
        elif "=" in tok:
            if not specs:
                raise InvalidArgumentError(
                    f"--methods: setting {tok!r} comes before any method; write e.g. 'probe:{tok}'."
                )
            _add_option(specs[-1][1], tok, specs[-1][0])
        else:
            specs.append((tok, {}))
    if not specs:
        raise InvalidArgumentError("--methods is empty; give e.g. 'ntp,pld,probe:bc=30'.")
    out: list[MethodSpec] = []
    for name, opts in specs:
        if not name:
            raise InvalidArgumentError(f"--methods: a setting list has no method name: {text!r}")
        label = name + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")
        if any(s.label == label for s in out):
            raise InvalidArgumentError(f"--methods lists {label!r} twice.")
        out.append(MethodSpec(label, name, dict(opts)))
    refs = [s for s in out if s.label == reference]
    rest = [s for s in out if s.label != reference]
    return [refs[0] if refs else MethodSpec(reference, reference, {}), *rest]


def _add_option(opts: dict[str, str], tok: str, method: str) -> None:
    key, sep, value = tok.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key or not value:
        raise InvalidArgumentError(
            f"--methods: {method} setting {tok!r} is not key=value (e.g. probe:bc=30,masks=2)."
        )
    if key in opts:
        raise InvalidArgumentError(f"--methods: {method} sets {key!r} twice.")
    opts[key] = value


@dataclass
class BenchConfig:
    """Everything that defines a benchmark run (see ``mlx-mtp bench --help``).

    Attributes:
        model: model spec (alias, folder, .gguf, repo id).
        methods: method settings; the first is the ``ntp`` reference.
        mode: ``specbench`` or ``gsm8k``.
        questions: Spec-Bench style jsonl (None: the copy in the package).
        gsm8k: GSM8K jsonl (``question``, ``answer``) for ``gsm8k`` mode.
        categories: tasks or categories to run (None: all six tasks).
        limit: prompts per category (None: all).
        max_tokens: new tokens per answer.
        turns: 1, or 2 for MT-bench second turns (after ntp's first answer).
        temp: sampling temperature (0 = greedy).
        seed: base random seed (sampling and method seeds).
        repeats: how many times each prompt is run per method.
        dtype: compute dtype (None: the platform default).
        interleave: run all methods of a prompt at once, one decoding step of
            each in turn (see :func:`mlx_mtp.bench.runner._run_interleaved`),
            for speed ratios on a machine whose speed drifts; peak memory is
            then that of all methods together.
        draft_model: the draft model of ``draft`` and ``mlx_lm_draft`` rows
            that name none (None: such rows are refused).
        device: the simulated device to run on, in the form of
            ``MLX_MTP_SIMULATE_DEVICE`` (``"profile=m4pro-4bit,ms_per_token=12"``,
            :mod:`mlx_mtp.bench.simulate`); None: that variable's, if set.
        runner: ``auto``, ``pipelined`` or ``synchronous``: the runner of
            each method's draft steps (:mod:`mlx_mtp.runners`).
        out: output folder.
    """

    model: str = "smollm2-135m"
    methods: list[MethodSpec] = field(default_factory=lambda: parse_methods("ntp"))
    mode: str = "specbench"
    questions: str | None = None
    gsm8k: str | None = None
    categories: list[str] | None = None
    limit: int | None = None
    max_tokens: int = 256
    turns: int = 1
    temp: float = 0.0
    seed: int = 0
    repeats: int = 1
    dtype: str | None = None
    interleave: bool = False
    draft_model: str | None = None
    device: str | None = None
    runner: str = "auto"
    out: str = "bench-out"

    def validate(self) -> None:
        """Check ranges and names.

        Raises:
            InvalidArgumentError: naming the bad setting.
        """
        if self.mode not in ("specbench", "gsm8k"):
            raise InvalidArgumentError(f"--mode must be specbench or gsm8k, got {self.mode!r}")
        if self.turns not in (1, 2):
            raise InvalidArgumentError(f"--turns must be 1 or 2, got {self.turns}")
        if self.mode == "gsm8k" and self.turns != 1:
            raise InvalidArgumentError("--turns 2 only applies to Spec-Bench (MT-bench turns).")
        if self.max_tokens <= 0:
            raise InvalidArgumentError(f"--max-tokens must be > 0, got {self.max_tokens}")
        if self.limit is not None and self.limit <= 0:
            raise InvalidArgumentError(f"--limit must be > 0, got {self.limit}")
        if self.repeats <= 0:
            raise InvalidArgumentError(f"--repeats must be > 0, got {self.repeats}")
        if not self.temp >= 0 or self.temp == float("inf"):
            raise InvalidArgumentError(f"--temp must be a finite number >= 0, got {self.temp}")
        if not str(self.out).strip():
            raise InvalidArgumentError("--out is empty; give an output folder.")
        check_runner(self.runner)
        if not self.methods or self.methods[0].name != "ntp":
            raise InvalidArgumentError("the first method must be the ntp reference")

    def settings(self) -> dict[str, Any]:
        """The settings that must match for a run to resume (``out`` excluded)."""
        d = asdict(self)
        d.pop("out")
        if not self.interleave:  # folders written before the option existed stay resumable
            d.pop("interleave")
        if self.draft_model is None:
            d.pop("draft_model")
        if self.device is None:
            d.pop("device")
        if self.runner == "auto":
            d.pop("runner")
        d["methods"] = [m.label for m in self.methods]
        return d
