"""Shared fixtures. Importing tandem first makes the BLAS choice before mlx loads."""

from __future__ import annotations

import tandem  # noqa: F401  (must precede any mlx import)
import pytest

from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight 2-layer llama with a real BPE tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_quantized_model_dir(tmp_path_factory):
    """The same architecture with 4-bit group-32 quantized linear layers."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-q4"), quantize=True)
