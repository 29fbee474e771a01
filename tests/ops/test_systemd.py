"""systemd units, the example config and install.sh."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import config

ROOT = Path(__file__).resolve().parents[2]
UNITS = sorted((ROOT / "ops" / "systemd").glob("*.service"))
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes"}


def parse(unit: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str
    cp.read_string(unit.read_text())
    return cp


def test_the_four_units_exist():
    assert [u.name for u in UNITS] == [
        "tandem-broker.service", "tandem-decode@.service", "tandem-edge.service", "tandem-prefill@.service",
    ]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_units_are_notify_hardened_and_get_the_secret_as_a_credential(unit):
    service = parse(unit)["Service"]
    assert service["Type"] == "notify"
    for key, value in HARDENING.items():
        assert service[key] == value, key
    assert service["User"] == "tandem"
    assert service["LoadCredential"] == "cluster-secret:/etc/tandem/cluster-secret"
    assert "StateDirectory" in service and "CacheDirectory" in service
    assert "--config /etc/tandem/tandem.toml" in service["ExecStart"]


@pytest.mark.parametrize("name", ["tandem-prefill@.service", "tandem-decode@.service"])
def test_workers_have_a_watchdog(name):
    service = parse(ROOT / "ops" / "systemd" / name)["Service"]
    assert int(service["WatchdogSec"]) > 0 and "%i" in service["ExecStart"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_passes(tmp_path):
    tandem_bin = Path(sys.executable).parent / "tandem"
    names = []
    for unit in UNITS:
        text = unit.read_text().replace("/opt/tandem/venv/bin/tandem", str(tandem_bin))
        name = unit.name.replace("@.", "@5600.") if "@" in unit.name else unit.name
        (tmp_path / name).write_text(text)
        names.append(name)
    proc = subprocess.run(["systemd-analyze", "verify", *names], cwd=tmp_path, capture_output=True, text=True)
    # Warnings (unknown keys, bad values) are printed but do not change the exit status.
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stderr


def test_example_config_is_current_and_loads():
    example = ROOT / "ops" / "tandem.toml.example"
    assert example.read_text() == config.render_example(), "regenerate: python -c 'import tandem.config as c; print(c.render_example(), end=\"\")' > ops/tandem.toml.example"
    assert config.load(example, env={}) == config.Config()
