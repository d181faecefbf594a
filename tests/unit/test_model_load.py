"""engine.model's dtype policy on the CPU backend (what the GPU suite checks on CUDA)."""

from __future__ import annotations

import os

import pytest

from tqserve.engine.model import TF32_ENV, keep_float32_exact, load_model, resolve_dtype


def test_auto_is_float32_on_the_cpu_and_bad_dtypes_are_named():
    assert resolve_dtype("auto") == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64")


def test_float32_is_exact_off_cuda_and_the_environment_is_left_alone(monkeypatch):
    monkeypatch.delenv(TF32_ENV, raising=False)
    assert keep_float32_exact()
    assert TF32_ENV not in os.environ  # no TF32 on this backend: nothing to ask of MLX


def test_a_missing_model_is_a_load_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        load_model(tmp_path / "nothing-here", "float32")


def test_quantized_weights_choices_are_checked_and_named():
    from tqserve.engine.config import Config

    assert Config().quantized_weights == "auto"
    with pytest.raises(ValueError, match="--quantized-weights must be one of auto, keep, "
                                         "dequantize, got 'packed'"):
        Config(quantized_weights="packed")


def test_a_float_model_has_nothing_to_dequantize():
    from tqserve.engine.model import DEFAULT_MODEL

    loaded = load_model(DEFAULT_MODEL, "float32", "dequantize")
    assert loaded.quantized_weights == "none"
    assert loaded.fingerprint == load_model(DEFAULT_MODEL, "float32", "keep").fingerprint
