"""Edges where input or state reaches MLX unchecked (issue 16, items 7-11):
seeded sampling independent of tree size, a model without a chat template,
a model folder with a missing tensor, recurrent-cache models, and work left
running on another stream by mlx-lm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.api import MTPModel
from mlx_mtp.budget import CostCurve
from mlx_mtp.errors import ModelLoadError, UnsupportedModelError
from mlx_mtp.loading import LoadedModel, load_model
from mlx_mtp.methods import make_method
from mlx_mtp.sampling import PositionalSampler, position_keys

PROMPT = "Write a short story about a robot."


# ----------------------------------------------------------- seeded sampling
def test_positional_sampler_depends_only_on_seed_and_position():
    lp = mx.log(mx.array([[0.4, 0.3, 0.2, 0.1]] * 6))
    s = PositionalSampler(1.0, seed=11)
    full = np.array(s(lp, np.arange(10, 16)))
    # the same positions drawn alone, or in another batch order, give the same tokens
    alone = [int(np.array(s(lp[:1], [p]))[0]) for p in range(10, 16)]
    rev = np.array(s(lp, np.arange(15, 9, -1)))[::-1]
    assert full.tolist() == alone == rev.tolist()
    keys = np.array(position_keys(11, [10, 11]))
    assert keys.shape == (2, 2) and not (keys[0] == keys[1]).all()
    # different seeds do differ over many positions
    big = mx.log(mx.array([[0.25] * 4] * 64))
    a = np.array(PositionalSampler(1.0, seed=1)(big, np.arange(64)))
    b = np.array(PositionalSampler(1.0, seed=2)(big, np.arange(64)))
    assert (a != b).sum() > 20


def test_positional_sampler_distribution_and_filters():
    n = 40_000
    p = np.array([0.5, 0.3, 0.15, 0.05])
    lp = mx.log(mx.array(np.tile(p, (n, 1)).astype(np.float32)))
    got = np.bincount(np.array(PositionalSampler(1.0, seed=3)(lp, np.arange(n))), minlength=4) / n
    assert np.abs(got - p).max() < 0.01, got
    # temperature 0.5 sharpens: p^2 normalised
    q = p**2 / (p**2).sum()
    got = np.bincount(np.array(PositionalSampler(0.5, seed=4)(lp, np.arange(n))), minlength=4) / n
    assert np.abs(got - q).max() < 0.01, got
    # top-p 0.7 keeps the two most likely tokens (mass 0.8), top-k 1 only the first
    got = np.bincount(
        np.array(PositionalSampler(1.0, top_p=0.7, seed=5)(lp, np.arange(n))), minlength=4
    )
    assert got[2:].sum() == 0 and abs(got[0] / n - 0.625) < 0.01
    got = np.array(PositionalSampler(1.0, top_k=1, seed=6)(lp[:1000], np.arange(1000)))
    assert (got == 0).all()
    # limits that underflow float32 still mean "the most likely token", not token 0
    lp = mx.log(mx.array([[0.1, 0.2, 0.6, 0.1]] * 50))
    for s in (PositionalSampler(1e-300, seed=1), PositionalSampler(1.0, top_p=1e-300, seed=1)):
        assert (np.array(s(lp, np.arange(50))) == 2).all()


@pytest.fixture(scope="module")
def seeded_runs(smollm):
    """Seeded samples (temp 0.9, top-p 0.95, seed 5, 12 tokens) of several
    methods and tree sizes: {label: (tokens, accepted drafts)}."""
    runs = {}
    settings = {
        "ntp": ("ntp", {}),
        "probe bc=10": ("probe", {"bc": 10}),
        "hybrid bc=10": ("hybrid", {"bc": 10}),
        "pld": ("pld", {}),
    }
    for label, (name, opts) in settings.items():
        m = MTPModel(smollm, make_method(name, **opts))
        r = m.generate(PROMPT, max_tokens=12, temp=0.9, top_p=0.95, seed=5)
        runs[label] = (r.tokens, r.stats.accepted)
    return runs


def test_seeded_output_is_independent_of_the_method_and_tree(seeded_runs):
    ref, _ = seeded_runs["ntp"]
    for label, (tokens, _) in seeded_runs.items():
        assert tokens == ref, label
    # the speculative runs did accept drafts (so the trees really differed)
    assert sum(acc for label, (_, acc) in seeded_runs.items() if label != "ntp") > 0


@pytest.mark.parametrize("method", ["probe", "hybrid"])
def test_seeded_bc_auto_same_whatever_the_timing(smollm, seeded_runs, method):
    """bc=auto sizes the tree from the measured cost curve; force two very different
    costs (so two different tree sizes) and check the text is the same."""
    outs, slots = [], []
    for cost in (0.0, 0.4):
        m = MTPModel(smollm, make_method(method, bc="auto", max_bc=24))
        m.ctx.curves = CostCurve.linear(cost)  # what the cost curve would have timed
        r = m.generate(PROMPT, max_tokens=12, temp=0.9, top_p=0.95, seed=5)
        outs.append(r.tokens)
        slots.append(r.stats.slots_per_forward)
    assert slots[0] > slots[1] + 1, slots  # the trees differed in size
    assert outs[0] == outs[1] == seeded_runs["ntp"][0]


def test_other_seed_other_text(smollm, seeded_runs):
    m = MTPModel(smollm, make_method("ntp"))
    r = m.generate(PROMPT, max_tokens=12, temp=0.9, top_p=0.95, seed=6)
    assert r.tokens != seeded_runs["ntp"][0]


# ------------------------------------------------------ no chat template
@pytest.fixture
def no_template_model():
    lm = load_model("smollm2-135m", dtype="float32")  # a fresh tokenizer object
    lm.tokenizer._tokenizer.chat_template = None
    assert not getattr(lm.tokenizer, "chat_template", None)
    return lm


def test_chat_without_template_falls_back_to_plain_turns(no_template_model):
    m = MTPModel(no_template_model, make_method("pld"))
    chat = m.chat()
    with pytest.warns(UserWarning, match="no chat template"):
        first = list(chat.send("My name is Alice.", max_tokens=6))
    second = list(chat.send("What is my name?", max_tokens=6))
    assert first and second
    st = second[-1].stats
    # the second turn reuses the first turn's cache: only the new text is prefilled
    assert st.prefill_tokens < st.prompt_tokens - 5
    tok = no_template_model.tokenizer
    text = tok.decode(m.encode(chat.messages[:3]))
    assert text.startswith("user: My name is Alice.\nassistant: ")
    assert text.endswith("user: What is my name?\nassistant: ")


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_cli_chat_without_template(smollm, tmp_path, capsys):
    from conftest import run_cli

    folder = _copy_model(smollm.path, tmp_path / "no-template")
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / extra).unlink(missing_ok=True)
    argv = ["chat", "--model", str(folder), "-n", "4"]
    with pytest.warns(UserWarning, match="no chat template"):  # shown once on stderr
        code, err = run_cli(argv, capsys, stdin="Hello there\n/quit\n")
    assert code == 0, err
    assert "Traceback" not in err
    assert "[ntp] plain: 4 tokens" in err


def test_cli_says_when_an_answer_is_cut_at_its_token_limit(capsys):
    """``generate`` and ``chat`` print a line on stderr when an answer stopped
    at -n (finish reason "length"), and none when it ended by itself."""
    from types import SimpleNamespace

    from conftest import run_cli

    from mlx_mtp import cli

    for argv, stdin in ((["generate", "-p", "Tell me a story."], None), (["chat"], "Hi\n")):
        code, err = run_cli([*argv, "-n", "3"], capsys, stdin=stdin)
        assert code == 0, err
        assert "[cut at 3 tokens: raise -n for a longer answer]" in err, err
    stats = SimpleNamespace(generated_tokens=2, summary=lambda: "[ntp] 2 tokens")
    cli._end_note(SimpleNamespace(finish_reason="stop", stats=stats))
    assert capsys.readouterr().err == "[ntp] 2 tokens\n"


# --------------------------------------------------------- missing tensor
def test_missing_tensor_is_named(smollm, tmp_path):
    folder = _copy_model(smollm.path, tmp_path / "broken")
    weights = mx.load(str(folder / "model.safetensors"))
    gone = "model.layers.3.self_attn.k_proj.weight"
    prefix = gone.rsplit(".", 1)[0]
    weights = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.self_attn\.k_proj"):
        load_model(str(folder))


# ---------------------------------------------------- recurrent-cache models
TINY_RECURRENT = {
    "mamba": {
        "model_type": "mamba",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    },
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "intermediate_size": 128,
        "layer_types": ["conv", "full_attention"],
    },
}


@pytest.mark.parametrize("family", sorted(TINY_RECURRENT))
def test_recurrent_models_refused_at_load(smollm, family):
    from mlx_lm.utils import _get_classes

    config = TINY_RECURRENT[family]
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    loaded = LoadedModel(model, smollm.tokenizer, smollm.path, config, family, "float32")
    for name in ("pld", "probe", "lookahead", "hybrid", "clp", "confadapt"):
        with pytest.raises(UnsupportedModelError, match=f"--method {name} cannot run .*{family}"):
            MTPModel(loaded, make_method(name))
    out = MTPModel(loaded, make_method("ntp")).generate([1, 2, 3], max_tokens=3)
    assert len(out.tokens) == 3


# ---------------------------------------------- work left on mlx-lm's stream
def test_decoding_after_an_abandoned_mlx_lm_generator(smollm, greedy_reference):
    """mlx-lm's generator queues its next step with mx.async_eval on its own
    stream; leaving it early and then decoding here must give the same tokens."""
    from mlx_lm.generate import stream_generate

    m = MTPModel(smollm, make_method("probe", bc=10))
    ids = m.encode("Name three colours.")
    ref = greedy_reference(ids, 12)
    held = []
    for r in range(3):
        gen = stream_generate(smollm.model, smollm.tokenizer, "Tell me a story " * (r + 1))
        for _ in range(3):
            next(gen)
        held.append(gen)  # left suspended, its next step in flight
        m.engine.reset()
        assert m.generate(ids, max_tokens=12).tokens == ref


def test_ntp_past_a_sliding_window(smollm):
    """Plain decoding keeps working once a sliding-window cache wraps (the
    pipelined step must not leave a token that the wrapped cache cannot drop)."""
    m = MTPModel(smollm, make_method("ntp"), max_kv_size=40)
    ids = m.encode("Count from one to forty in words, separated by commas.")
    out = m.generate(ids, max_tokens=30)
    assert len(out.tokens) == 30 or out.finish_reason == "stop"
    assert m.engine.offset == len(ids) - 1 + len(out.tokens)  # the loop's invariant
