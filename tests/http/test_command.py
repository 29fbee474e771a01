"""`tandem edge` and ops/gunicorn.conf.py without starting servers (the integration tests start them)."""

from __future__ import annotations

import runpy

import pytest

from tandem.cli import main
from tandem.commands import edge as edge_cmd


def test_conflicting_key_flags_are_a_one_line_error(capsys):
    assert main(["edge", "--api-key", "a", "--api-key-file", "b"]) == 2
    assert "not both" in capsys.readouterr().err


def test_missing_model_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["edge", "--model", str(tmp_path / "nope"), "--dev"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_missing_api_key_file_is_refused(tiny_model_dir, tmp_path, capsys):
    code = main(["edge", "--model", str(tiny_model_dir), "--dev", "--api-key-file", str(tmp_path / "absent")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_gunicorn_conf_reads_tandem_config(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_EDGE_BIND", "127.0.0.1:9123")
    monkeypatch.setenv("TANDEM_EDGE_WORKERS", "3")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert edge_cmd.CONF == "python:tandem.http.gunicorn_conf"  # packaged: works without a source checkout
    conf = runpy.run_module("tandem.http.gunicorn_conf")
    assert conf["bind"] == ["127.0.0.1:9123"] and conf["workers"] == 3
    assert conf["worker_class"] == "tandem.http.edge_worker.EdgeWorker" and conf["preload_app"] is True
    assert conf["wsgi_app"] == "tandem.http.app:gunicorn_app()"
    assert conf["asgi_lifespan"] == "on" and callable(conf["child_exit"])


def test_bad_config_value_is_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_EDGE_WORKERS", "-1")
    assert main(["edge", "--dev"]) == 2


def test_edge_workers_default_to_one_per_four_cores(monkeypatch):
    import os

    from tandem.http.settings import EdgeSettings

    for cores, want in ((2, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert EdgeSettings().worker_count() == want
    assert EdgeSettings(workers=3).worker_count() == 3


def test_ops_gunicorn_conf_is_the_packaged_config():
    from pathlib import Path

    import tandem.http.gunicorn_conf as packaged

    shim = runpy.run_path(str(Path(__file__).resolve().parents[2] / "ops" / "gunicorn.conf.py"))
    for key in ("bind", "workers", "worker_class", "wsgi_app", "asgi_lifespan", "preload_app", "timeout"):
        assert shim[key] == getattr(packaged, key)
    assert shim["child_exit"] is packaged.child_exit and shim["on_exit"] is packaged.on_exit
