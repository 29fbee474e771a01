"""The cluster secret: where it comes from, and who may run without one.

Sources, first found wins: ``--cluster-secret-file`` (or ``[security]
cluster_secret_file``), ``$CREDENTIALS_DIRECTORY/cluster-secret`` (systemd
``LoadCredential=cluster-secret:...``), ``$TANDEM_CLUSTER_SECRET_FILE``,
``$TANDEM_CLUSTER_SECRET`` (the secret itself). A file's trailing newline is not
part of the secret, so ``openssl rand -hex 32 > secret`` works as well as raw bytes.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
CREDENTIAL_NAME = "cluster-secret"

HOW_TO_CREATE = (
    "create one with `head -c 32 /dev/urandom > cluster.secret && chmod 600 cluster.secret`, "
    "copy it to every node, and pass --cluster-secret-file cluster.secret "
    "(or set TANDEM_CLUSTER_SECRET_FILE, or load it as the systemd credential 'cluster-secret')"
)


class ClusterSecretError(ValueError):
    """No usable cluster secret; the message says how to make one. (The wire knows
    nothing of the config: the command line reports this as it reports a ConfigError.)"""


def load_cluster_secret(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The secret from the first source that has one, or None if no source is set."""
    env = os.environ if env is None else env
    if path:
        return _read(Path(path), "--cluster-secret-file")
    cred_dir = env.get("CREDENTIALS_DIRECTORY")
    if cred_dir and (Path(cred_dir) / CREDENTIAL_NAME).exists():
        return _read(Path(cred_dir) / CREDENTIAL_NAME, "systemd credential")
    if env.get("TANDEM_CLUSTER_SECRET_FILE"):
        return _read(Path(env["TANDEM_CLUSTER_SECRET_FILE"]), "$TANDEM_CLUSTER_SECRET_FILE")
    if env.get("TANDEM_CLUSTER_SECRET"):
        return _check(env["TANDEM_CLUSTER_SECRET"].encode(), "$TANDEM_CLUSTER_SECRET")
    return None


def require_cluster_secret(
    role: str,
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    *,
    loopback_only: bool = False,
) -> bytes | None:
    """The secret a process of ``role`` must run with.

    Only a ``hybrid`` (single-node) deployment whose sockets are all on loopback may run
    without one (development mode: returns None and logs a warning); every other role
    raises :class:`ClusterSecretError` saying how to create a secret.
    """
    secret = load_cluster_secret(path, env)
    if secret is not None:
        return secret
    if role == "hybrid" and loopback_only:
        log.warning("no cluster secret: running unauthenticated (development mode, loopback only)")
        return None
    raise ClusterSecretError(f"{role} needs a cluster secret of at least {MIN_SECRET_BYTES} bytes: {HOW_TO_CREATE}")


def _read(path: Path, source: str) -> bytes:
    try:
        data = path.read_bytes()
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ClusterSecretError(f"{source}: {path} does not exist; {HOW_TO_CREATE}") from None
    except OSError as exc:
        raise ClusterSecretError(f"{source}: cannot read {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("cluster secret %s is readable by other users; run chmod 600 %s", path, path)
    return _check(data.rstrip(b"\r\n"), f"{source} {path}")


def _check(secret: bytes, source: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ClusterSecretError(
            f"{source}: cluster secret is {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed; {HOW_TO_CREATE}"
        )
    return secret
