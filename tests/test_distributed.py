"""Sharded models (mlx.distributed, ring backend on loopback): every method
gives the unsharded output and every rank takes the same decisions.

The ranks are spawned here as subprocesses with ``MLX_HOSTFILE``/``MLX_RANK``
(not with ``mlx.launch``, which exits 0 even when a rank fails), each with a
timeout, and every rank's exit code is checked. One pair of processes runs
all tiny-model cases (tests/dist_worker.py) and the tests below read its
report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from mlx_mtp import distributed
from mlx_mtp.context import Context
from mlx_mtp.errors import MTPError, UnsupportedModelError

WORKER = Path(__file__).with_name("dist_worker.py")
METHOD_CASES = [
    "ntp",
    "pld",
    "probe",
    "probe-auto",
    "hybrid",
    "hybrid-auto",
    "lookahead",
    "clp",
    "clp-paper",
]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn_ranks(
    n: int, argv: list[str], tmp: Path, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """Run ``argv`` as ``n`` ranks of a ring group on loopback and wait for all.

    Fails the test, with every rank's stderr, when a rank times out or exits
    non-zero."""
    host = tmp / "hostfile.json"
    host.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    procs = []
    for r in range(n):
        env = {
            **os.environ,
            "MLX_HOSTFILE": str(host),
            "MLX_RANK": str(r),
            "OPENBLAS_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1][-2000:] for p in procs]
        pytest.fail(f"a rank did not finish in {timeout} s; stderr: {errs}")
    for r, c in enumerate(done):
        assert c.returncode == 0, f"rank {r} exited {c.returncode}: {c.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    spawn_ranks(2, [sys.executable, str(WORKER), str(tmp), "tiny"], tmp)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_agree_shares_rank0_value(tiny_report):
    r0, r1 = tiny_report
    assert (r0["size"], r1["size"]) == (2, 2)
    assert r0["agree"] == r1["agree"] == {"rank": 0, "x": 0.1}
    assert r0["agree_flag"] is r1["agree_flag"] is True
    assert r0["seed"] == r1["seed"]


@pytest.mark.parametrize("family,how", [("llama", "tensor"), ("qwen2", "pipeline")])
def test_sharded_logits_match_unsharded(tiny_report, family, how):
    for rep in tiny_report:
        assert rep[family]["sharding"] == how
        assert rep[family]["logits_diff"] <= 1e-4


@pytest.mark.parametrize("temp", [0.0, 0.8])
@pytest.mark.parametrize("case", METHOD_CASES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sharded_methods_match(tiny_report, family, case, temp):
    """Same tokens as the unsharded model, and the same steps on both ranks
    (same drafts accepted, same slot costs: under bc=auto rank 1 is made to
    time its forward passes much slower, and rank 0's cost must still win)."""
    r0, r1 = (rep[family][f"{case}@{temp}"] for rep in tiny_report)
    assert len(r0["unsharded"]["tokens"]) == 24
    assert r0["sharded"]["tokens"] == r0["unsharded"]["tokens"]
    assert r1["sharded"] == r0["sharded"]
    if case.endswith("-auto"):  # a cost curve measured on both ranks, rank 0's used by both
        assert r0["sharded"]["curve"] and len(r0["sharded"]["curve"][0]) > 1, "no curve measured"


def test_serve_worker_on_two_ranks(tiny_report):
    """``mlx-mtp serve``'s worker on a tiny llama sharded over 2 ranks: rank 0
    takes the jobs, rank 1 follows every one (also the one whose client left
    after the first step) and ends when rank 0's worker stops; the answers
    equal the unsharded model's."""
    r0, r1 = tiny_report
    assert r0["sharding"] == r1["sharding"] == "tensor"
    jobs, ref = r0["jobs"], r0["ref"]
    for name in ("probe", "pld", "seeded"):
        text, event, finish = jobs[name]
        assert (event, finish) == ("done", "length")
        assert text == ref[name]
    assert ref["seeded"] != ref["probe"]  # sampling really sampled
    assert jobs["cancelled"][1:] == ["done", "cancelled"]
    assert r0["counts"] == r1["counts"] == {"done": 3, "cancelled": 1, "failed": 0, "rejected": 0}
    assert r1["ref"] == ref


def test_tensor_parallel_refusal_names_sizes_that_work():
    """SmolLM2's shape (9 query / 3 KV heads) on llama, which has no pipeline:
    4 ranks are refused, naming 3; nothing is changed."""

    class Group:
        def size(self):
            return 4

        def rank(self):
            return 0

    model = make_tiny_model(
        "llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72, intermediate_size=96
    )
    assert distributed.tensor_sizes(model, up_to=9) == [1, 3]
    with pytest.raises(UnsupportedModelError, match=r"9 query / 3 key-value heads.*1, 3 ranks"):
        distributed.shard_model(model, Group())
    with pytest.raises(UnsupportedModelError, match="no pipeline parallelism"):
        distributed.shard_model(model, Group(), pipeline=True)
    assert distributed.sharding(model) is None


def test_falls_back_to_pipeline_where_heads_do_not_divide():
    class Group:
        def size(self):
            return 3

        def rank(self):
            return 1

    model = make_tiny_model("qwen2", num_hidden_layers=3)  # 4 heads: not over 3 ranks
    assert distributed.shard_model(model, Group()) == "pipeline"
    assert distributed.sharding(model) == "pipeline"
    assert len(model.model.pipeline_layers) == 1
    too_few = make_tiny_model("qwen2", num_hidden_layers=2)
    with pytest.raises(MTPError, match="2 layers, fewer than the 3 ranks"):
        distributed.shard_model(too_few, Group(), pipeline=True)


def test_alone_everything_is_a_no_op():
    assert distributed.group() is None
    assert (distributed.size(), distributed.rank(), distributed.is_main()) == (1, 0, True)
    assert distributed.agree({"a": 1}) == {"a": 1}
    assert distributed.agree_flag(True) is True
    distributed.barrier()


@pytest.mark.slow
def test_smollm_three_ranks_probe_equals_one_process(smollm, tmp_path):
    """The embedded SmolLM2 (9 query / 3 KV heads) tensor-parallel over 3 ranks:
    probe gives the one-process text token for token (float32), in fewer
    forward passes than tokens. Slow on a shared 2-core machine: three ranks
    compete for the cores and each of the 60 all_sums of a forward pass waits
    for all three to be scheduled (about 0.15 s each under load here)."""
    spawn_ranks(3, [sys.executable, str(WORKER), str(tmp_path), "smollm"], tmp_path, 1500)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    from mlx_mtp.api import MTPModel
    from mlx_mtp.methods import make_method

    one = MTPModel(smollm, make_method("probe")).generate(
        "List three facts about the Moon.", max_tokens=24, temp=0.0
    )
    for rep in reps:
        assert rep["sharding"] == "tensor"
        assert rep["probe"]["tokens"] == one.tokens
        assert rep["probe"]["text"] == one.text
        assert rep["probe"]["forwards"] == one.stats.forward_passes < 24


def test_confadapt_refuses_an_unsharded_adapter_on_a_sharded_model():
    """An on-device adapter's LoRA weights are for the whole model: refused
    clearly on a sharded one (here pipeline-sharded over a pretend 2-rank
    group), before any adapter tensor is read."""
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods.confadapt import SHIPPED_ADAPTERS, ConfAdapt

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 0

    model = make_tiny_model("qwen2")
    distributed.shard_model(model, Group(), pipeline=True)
    engine = Engine(model)
    with pytest.raises(UnsupportedModelError, match="sharded .*pipeline.*not sharded"):
        ConfAdapt(adapter=SHIPPED_ADAPTERS / "smollm2-135m-gsm8k").prepare(Context(engine))
    with pytest.raises(UnsupportedModelError, match="on-device adapter"):
        ConfAdapt().prepare(Context(engine))


def test_cli_generate_prints_on_rank0_only(tmp_path):
    """``mlx-mtp generate`` on 2 ranks (a tiny llama saved as a model folder,
    seeded sampling): rank 0 prints the one-process text, rank 1 nothing."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from dist_worker import tiny_folder
    finally:
        sys.path.pop(0)
    folder = tiny_folder(tmp_path)
    argv = [sys.executable, "-m", "mlx_mtp.cli", "generate", "--model", folder]
    argv += ["--method", "probe", "--temp", "0.9", "--seed", "3", "-n", "12", "-p", "Count."]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    one = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr
    r0, r1 = spawn_ranks(2, argv, tmp_path)
    assert r0.stdout == one.stdout and len(set(one.stdout)) > 3
    assert "sharded: tensor parallel over 2 ranks" in r0.stderr
    assert r1.stdout == r1.stderr == ""
