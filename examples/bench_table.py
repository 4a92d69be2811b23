"""One table from several ``mlx-mtp bench`` folders (a bench split by
``--categories`` over several processes, or a second run that adds methods):
per method, token equality with ``ntp``, tau, slots per forward pass, decode
speed against ``ntp`` per task and overall, prefill + decode against ``ntp``,
and against the fastest ``mlx_lm_draft`` row. Every folder must hold an
``ntp`` row. Each ratio divides rows measured side by side in one folder's
run: a method's time over the prompts it ran is set against the time of the
``ntp`` row of the same folders on the same prompts (overall figures are
total tokens over total time). A method that ran in only some folders is
shown over those folders' prompts (``exact`` says how many), and its
``vs mlx_lm_draft`` columns over the prompts both ran.

    python examples/bench_table.py docs/results/draft-pair-cpu-12x64/*/
"""

from __future__ import annotations

import sys

from mlx_mtp.bench.runner import read_records


def main(folders: list[str]) -> None:
    # (folder, prompt, method) -> record; a prompt is (qid, turn, repeat)
    by: dict[tuple[int, tuple, str], dict] = {}
    for i, d in enumerate(folders):
        for r in read_records(d):
            by[i, (r["qid"], r["turn"], r["repeat"]), r["method"]] = r
    missing = {(i, q) for i, q, _ in by} - {(i, q) for i, q, m in by if m == "ntp"}
    if missing:
        sys.exit(
            f"no ntp record for {len(missing)} prompts (e.g. {sorted(missing)[0]}): "
            "every folder needs an ntp row"
        )
    methods = list(dict.fromkeys(m for _, _, m in by))
    task = {q: r["task"] for (_, q, _), r in by.items()}
    tasks = list(dict.fromkeys(task.values()))

    def runs(m: str, t: str | None = None) -> list[tuple[int, tuple]]:
        """(folder, prompt) of every prompt ``m`` ran (on task ``t``)."""
        return [(i, q) for i, q, n in by if n == m and (t is None or task[q] == t)]

    def secs(m: str, keys: list[tuple[int, tuple]], prefill: bool = False) -> float:
        rs = [by[i, q, m] for i, q in keys]
        return sum(r["decode_time"] + prefill * r["prefill_time"] for r in rs)

    def speed(m: str, ref: str, t: str | None = None, prefill: bool = False) -> str:
        keys = [k for k in runs(m, t) if (*k, ref) in by]
        if not keys:
            return "-"
        toks = sum(by[i, q, m]["generated_tokens"] for i, q in keys)
        ref_toks = sum(by[i, q, ref]["generated_tokens"] for i, q in keys)
        ratio = (toks / secs(m, keys, prefill)) / (ref_toks / secs(ref, keys, prefill))
        return f"{ratio:.2f}x"

    peers = [m for m in methods if m.startswith("mlx_lm_draft")]
    best = None
    if peers:
        best = max(peers, key=lambda m: float(speed(m, "ntp")[:-1]))
    head = ["method", "exact", "tau", "slots/fwd", *tasks, "overall", "prefill+decode"]
    if best:
        head += [f"vs {best}", "(prefill+decode)"]
    print("| " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * (len(head) - 2))
    for m in methods:
        keys = runs(m)
        rs = [by[i, q, m] for i, q in keys]
        exact = sum(by[i, q, m]["tokens"] == by[i, q, "ntp"]["tokens"] for i, q in keys)
        fwd = sum(r["forward_passes"] for r in rs)
        gen = sum(r["generated_tokens"] for r in rs)
        slots = sum(r["slots"] for r in rs)
        row = [m, f"{exact}/{len(keys)}", f"{gen / fwd:.2f}", f"{slots / fwd:.1f}"]
        row += [speed(m, "ntp", t) for t in tasks]
        row += [speed(m, "ntp"), speed(m, "ntp", prefill=True)]
        if best:
            row += [speed(m, best), speed(m, best, prefill=True)]
        print("| " + " | ".join(row) + " |")
    keys = runs("ntp")
    toks = sum(by[i, q, "ntp"]["generated_tokens"] for i, q in keys)
    print(f"\nntp: {toks / secs('ntp', keys):.3f} tok/s decode")


if __name__ == "__main__":
    main(sys.argv[1:])
