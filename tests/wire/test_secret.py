from __future__ import annotations

import pytest

from tandem.wire.secret import ClusterSecretError, load_cluster_secret, require_cluster_secret


def _file(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    p.chmod(0o600)
    return p


def test_precedence(tmp_path):
    flag = _file(tmp_path, "flag", b"f" * 16)
    creds = tmp_path / "creds"
    creds.mkdir()
    _file(creds, "cluster-secret", b"c" * 16)
    envfile = _file(tmp_path, "envfile", b"e" * 16)
    env = {"CREDENTIALS_DIRECTORY": str(creds), "TANDEM_CLUSTER_SECRET_FILE": str(envfile), "TANDEM_CLUSTER_SECRET": "v" * 16}
    assert load_cluster_secret(flag, env) == b"f" * 16
    assert load_cluster_secret(None, env) == b"c" * 16
    del env["CREDENTIALS_DIRECTORY"]
    assert load_cluster_secret(None, env) == b"e" * 16
    del env["TANDEM_CLUSTER_SECRET_FILE"]
    assert load_cluster_secret(None, env) == b"v" * 16
    assert load_cluster_secret(None, {}) is None


def test_trailing_newline_is_not_part_of_the_secret(tmp_path):
    p = _file(tmp_path, "hex", b"ab" * 32 + b"\n")
    assert load_cluster_secret(p, {}) == b"ab" * 32


@pytest.mark.parametrize("data", [b"", b"short", b"x" * 15 + b"\n"])
def test_short_secret_refused_with_instructions(tmp_path, data):
    p = _file(tmp_path, "s", data)
    with pytest.raises(ClusterSecretError, match="head -c 32 /dev/urandom"):
        load_cluster_secret(p, {})


def test_missing_file_says_how_to_create(tmp_path):
    with pytest.raises(ClusterSecretError, match="does not exist.*head -c 32"):
        load_cluster_secret(tmp_path / "nope", {})


def test_roles_without_secret():
    assert require_cluster_secret("hybrid", env={}, loopback_only=True) is None
    for role, loopback in [("hybrid", False), ("prefill", True), ("decode", True), ("broker", True), ("edge", True)]:
        with pytest.raises(ClusterSecretError, match="needs a cluster secret"):
            require_cluster_secret(role, env={}, loopback_only=loopback)
    assert require_cluster_secret("decode", env={"TANDEM_CLUSTER_SECRET": "z" * 20}) == b"z" * 20
