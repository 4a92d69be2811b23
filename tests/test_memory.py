"""A model's weights against the machine's memory, checked before any weight
is read: the estimate from the safetensors headers (exact for the embedded
SmolLM2-135M, quantized on disk, in float32 and as stored), and a load, a GGUF
import and ``train mtp --full`` refused under a faked working set."""

from __future__ import annotations

import pytest

from mlx_mtp import loading, memory
from mlx_mtp.errors import ModelLoadError
from mlx_mtp.memory import weight_bytes, weights_bytes

MODEL = "smollm2-135m"


@pytest.fixture
def small_memory(monkeypatch):
    """A machine with ``set(bytes)`` of memory for weights, on which nothing
    may read a model's weights (``mlx_lm.load`` fails the test)."""

    def no_weight_read(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loading, "mlx_load", no_weight_read)

    def set_limit(n: int) -> None:
        monkeypatch.setattr(memory, "load_limit", lambda: (n, "faked working set"))

    return set_limit


def test_the_estimate_is_what_the_load_holds(smollm):
    """float32: the quantized weights' dequantized size (scales and biases
    gone; the 8-bit embedding and 4-bit layers both); auto: as stored."""
    stored, loaded = weights_bytes(smollm.path, "float32")
    assert loaded == weight_bytes(smollm.model)
    assert weights_bytes(smollm.path, "auto") == (stored, stored)
    assert stored <= (smollm.path / "model.safetensors").stat().st_size < loaded


def test_a_model_larger_than_memory_fails_before_any_weight_is_read(small_memory):
    loading.resolve_model(MODEL)  # imported already (not what is checked here)
    small_memory(200_000_000)
    with pytest.raises(ModelLoadError) as e:
        loading.load_model(MODEL, dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg
    assert "0.54 GB (0.54 GB of float32 weights; 0.10 GB as stored)" in msg, msg
    assert "more than the 0.20 GB faked working set" in msg, msg
    assert "a smaller or quantized model, or dtype 'auto' (--dtype auto)" in msg, msg
    small_memory(50_000_000)  # under even the stored weights: no --dtype auto advice
    with pytest.raises(ModelLoadError, match="weights as stored") as e:
        loading.load_model(MODEL, dtype="auto")
    assert "--dtype auto" not in str(e.value)


def test_the_cli_says_it_in_one_line(small_memory, capsys):
    from conftest import run_cli

    small_memory(200_000_000)
    code, err = run_cli(["generate", "-p", "Hi", "--dtype", "float32"], capsys)
    assert code == 2 and "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "faked working set" in line and "--dtype auto" in line


def test_the_mac_working_set_is_the_limit(monkeypatch):
    """On Apple silicon the GPU's recommended working set bounds the weights
    (faked here: this machine has no Metal device)."""
    info = {"max_recommended_working_set_size": 123_000_000}
    monkeypatch.setattr(memory.mx, "device_info", lambda: info, raising=False)
    assert memory.load_limit() == (123_000_000, "GPU working set")


def test_a_gguf_larger_than_memory_is_not_imported(tmp_path, monkeypatch):
    gguf = tmp_path / "big.gguf"
    gguf.write_bytes(b"\0" * 1000)
    monkeypatch.setattr(memory, "load_limit", lambda: (500, "faked working set"))
    with pytest.raises(ModelLoadError, match="GGUF file is 0.00 GB, more than"):
        loading._gguf_folder(gguf)


def test_full_training_counts_the_optimizer_copies(small_memory, monkeypatch, tmp_path):
    """train mtp --full holds the weights five times (model, student,
    gradients, AdamW's two moments): refused before the model loads where
    that is over the memory; --lora goes on to the load."""
    from mlx_mtp.commands import confadapt

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "What is 2 + 2?"}\n')
    small_memory(1_000_000_000)  # 0.54 GB fits once, not five times
    with pytest.raises(ModelLoadError) as e:
        confadapt.run_train_mtp(MODEL, str(data), tmp_path / "o", lora=False, dtype="float32")
    msg = str(e.value)
    assert "full fine-tuning" in msg and "2.69 GB (5 x 0.54 GB of float32 weights" in msg, msg
    assert "--lora" in msg, msg

    class Loads(Exception):
        pass

    def loads(*a, **k):
        raise Loads

    monkeypatch.setattr(confadapt, "load_model", loads)
    with pytest.raises(Loads):
        confadapt.run_train_mtp(MODEL, str(data), tmp_path / "o", lora=True, dtype="float32")
