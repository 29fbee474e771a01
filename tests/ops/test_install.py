"""ops/install.sh (issue #45 items 2 and 7): nothing happens without an explicit choice,
the venv's interpreter must be one the service user can run, a staged tree names the
paths it will live at, the config is readable by the services, and a failed or undone
install leaves nothing behind.

The --system runs happen in a private mount namespace whose /etc is a copy and whose
/opt, /var/lib and /var/cache are empty tmpfs: the real machine is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import config

ROOT = Path(__file__).resolve().parents[2]
INSTALL = str(ROOT / "ops" / "install.sh")
UNITS = sorted((ROOT / "ops" / "systemd").glob("*.service"))


def install(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", INSTALL, *args], capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)


def private_root_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a private mount namespace)"
    if shutil.which("unshare") is None or shutil.which("useradd") is None or shutil.which("runuser") is None:
        return "needs unshare, useradd and runuser"
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return "cannot create a mount namespace here"
    if not os.access("/usr/bin/python3", os.X_OK):
        return "needs /usr/bin/python3"
    return None


def in_private_root(tmp_path: Path, script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``script`` (bash) as root in a mount namespace with a copied /etc and empty
    /opt, /var/lib, /var/cache. ``$SRC`` is the checkout, ``$T`` a scratch directory."""
    prologue = f"""set -e
T={tmp_path}; SRC={ROOT}
cp -a /etc "$T/etc"
mount --bind "$T/etc" /etc
for d in /opt /var/lib /var/cache; do mount -t tmpfs tmpfs "$d"; done
set +e
"""
    return subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", prologue + script],
                          capture_output=True, text=True, timeout=timeout)


def test_no_choice_does_nothing(tmp_path):
    """Run as root with no arguments, the script used to install into / at once; so this
    runs it where / cannot be harmed (a broken script must not install on the test host)."""
    if os.geteuid() == 0:
        reason = private_root_available()
        if reason:
            pytest.skip(reason)
        proc = in_private_root(tmp_path, """cd "$T"; bash "$SRC/ops/install.sh"; echo "rc=$?"
bash "$SRC/ops/install.sh" --frobnicate; echo "rc=$?"
id tandem >/dev/null 2>&1 && echo "user made"
ls -d /opt/* /etc/tandem /var/lib/tandem /var/cache/tandem /etc/systemd/system/tandem-* 2>/dev/null | sed 's/^/made: /'
""")
        out = proc.stdout
    else:
        out = "".join(install(*a).stderr for a in ([], ["--frobnicate"]))
        proc = subprocess.CompletedProcess([], 0, "", out)
    lines = proc.stderr.strip().splitlines()
    assert "install.sh: choose --system, --stage DIR or --uninstall; nothing was done" in lines, proc.stderr
    assert "install.sh: unknown option --frobnicate (see --help)" in lines
    assert "--system" in proc.stderr and "made" not in out
    assert os.geteuid() != 0 or out.count("rc=2") == 2, out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root and runuser")
def test_an_interpreter_the_service_user_cannot_run_is_refused_before_anything(tmp_path):
    """A pyenv under a 0700 home (the venv links to it; the service got exit 126)."""
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    (private / "python3").symlink_to(Path(sys.base_prefix) / "bin" / "python3")
    stage = tmp_path / "stage"
    proc = install("--stage", str(stage), "--python", str(private / "python3"))
    assert proc.returncode == 2
    assert f"cannot run {private / 'python3'}" in proc.stderr and "nothing was done" in proc.stderr
    assert not stage.exists()


def test_stage_lays_out_units_and_a_config_the_services_can_read(tmp_path):
    proc = install("--stage", str(tmp_path), "--no-venv")
    assert proc.returncode == 0, proc.stderr
    for unit in UNITS:
        assert (tmp_path / "etc" / "systemd" / "system" / unit.name).read_text() == unit.read_text()
    toml = tmp_path / "etc" / "tandem" / "tandem.toml"
    assert toml.stat().st_mode & 0o777 == 0o640 and (tmp_path / "etc" / "tandem").stat().st_mode & 0o777 == 0o750
    assert config.load(toml, env={}) == config.Config()
    # A per-host secret is no part of a package: --system makes it on the host.
    assert not (tmp_path / "etc" / "tandem" / "cluster-secret").exists()
    # A second run keeps the operator's config.
    toml.write_text("[engine]\nparallel = 3\n")
    assert install("--stage", str(tmp_path), "--no-venv").returncode == 0
    assert config.load(toml, env={}).engine.parallel == 3


def _venv_for_tandem(tmp: Path) -> str:
    """Bash that builds /opt/tandem/venv from this checkout without its heavy dependencies
    (enough for `tandem --version` and loading the config, which is what install checks)."""
    return '/usr/bin/python3 -m venv /opt/tandem/venv && /opt/tandem/venv/bin/pip install -q --no-deps --no-build-isolation "$SRC" >/dev/null 2>&1 || /opt/tandem/venv/bin/pip install -q --no-deps "$SRC" >/dev/null'


@pytest.mark.timeout(300)
def test_system_install_lets_the_services_read_the_config_and_uninstall_purges(tmp_path):
    reason = private_root_available()
    if reason:
        pytest.skip(reason)
    script = f"""
# An operator's earlier /etc/tandem, root:root 0750 with a 0600 config: the services could not read it.
install -d -m 0750 /etc/tandem && echo '[engine]' > /etc/tandem/tandem.toml && chmod 0600 /etc/tandem/tandem.toml
{_venv_for_tandem(tmp_path)}
bash "$SRC/ops/install.sh" --system --no-venv --no-model; echo "rc=$?"
stat -c 'etc %U:%G %a' /etc/tandem; stat -c 'toml %U:%G %a' /etc/tandem/tandem.toml; stat -c 'secret %U:%G %a' /etc/tandem/cluster-secret
runuser -u tandem -- /opt/tandem/venv/bin/python -c 'import tandem.config as c; c.load("/etc/tandem/tandem.toml"); print("tandem reads the config")'
ls /etc/systemd/system | grep -c '^tandem-' | sed 's/^/units /'
bash "$SRC/ops/install.sh" --uninstall --purge; echo "uninstall rc=$?"
id tandem >/dev/null 2>&1 && echo "user left"
ls -d /opt/tandem /etc/tandem /var/lib/tandem /var/cache/tandem 2>/dev/null | sed 's/^/left: /'
ls /etc/systemd/system | grep '^tandem-' | sed 's/^/unit left: /'
echo end
"""
    proc = in_private_root(tmp_path, script)
    out = proc.stdout
    assert "rc=0" in out, out + proc.stderr
    assert "etc root:tandem 750" in out and "toml root:tandem 640" in out and "secret root:root 600" in out, out
    assert "tandem reads the config" in out and "units 4" in out, out + proc.stderr
    assert "uninstall rc=0" in out and "user left" not in out and "left:" not in out, out
    assert out.rstrip().endswith("end")


@pytest.mark.timeout(300)
def test_a_system_install_that_fails_halfway_removes_what_it_created(tmp_path):
    reason = private_root_available()
    if reason:
        pytest.skip(reason)
    # --no-venv with no venv at /opt/tandem/venv: the user, /etc/tandem and the units are
    # made before the check as the service user fails.
    script = """
bash "$SRC/ops/install.sh" --system --no-venv --no-model; echo "rc=$?"
id tandem >/dev/null 2>&1 && echo "user left"
ls -d /opt/tandem /etc/tandem /var/lib/tandem /var/cache/tandem 2>/dev/null | sed 's/^/left: /'
ls /etc/systemd/system | grep '^tandem-' | sed 's/^/unit left: /'
echo end
"""
    proc = in_private_root(tmp_path, script)
    assert "rc=0" not in proc.stdout and "removing what this run created" in proc.stderr, proc.stdout + proc.stderr
    assert "left" not in proc.stdout and proc.stdout.rstrip().endswith("end"), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_staged_tree_works_once_moved_to_root(tmp_path, tiny_model_dir):
    """--stage builds the real venv (all dependencies) under DIR; nothing in it names DIR;
    copied to / (here: a private /opt) and finished with --system --no-venv, the service
    user runs the model with it."""
    reason = private_root_available()
    if reason:
        pytest.skip(reason)
    stage = tmp_path / "stage"
    proc = install("--stage", str(stage), timeout=800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    named = subprocess.run(["grep", "-rlF", str(stage), str(stage / "opt")], capture_output=True, text=True)
    assert named.stdout == "", f"files still name the staging directory:\n{named.stdout[:2000]}"
    script = f"""
cp -a "{stage}/opt/tandem" /opt/tandem
cp -a "{stage}/etc/tandem" /etc/tandem
bash "$SRC/ops/install.sh" --system --no-venv --no-model; echo "rc=$?"
cp -r "{tiny_model_dir}" /var/lib/tandem/tiny && chown -R tandem:tandem /var/lib/tandem/tiny
runuser -u tandem -- /opt/tandem/venv/bin/tandem generate --quiet --model /var/lib/tandem/tiny --max-tokens 3 hello; echo "generate rc=$?"
"""
    out = in_private_root(tmp_path, script, timeout=300)
    assert "rc=0" in out.stdout and "generate rc=0" in out.stdout, out.stdout + out.stderr
