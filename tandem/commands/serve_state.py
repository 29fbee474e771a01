"""What a running `tandem serve` leaves in its state directory so that `tandem client`
and `tandem stats` on the same machine find it without flags: the broker's addresses
and the cluster secret's path (never the secret itself), in ``serve.json``.

The file is written once the stack is ready and removed when serve stops; a file left
by a serve that was killed is recognised by its process id and ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "serve.json"


def state_dir(arg: str | None = None) -> Path:
    """--state-dir, else $XDG_STATE_HOME/tandem (~/.local/state/tandem)."""
    if arg:
        return Path(arg)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "tandem"


def publish(directory: Path, *, addresses: dict[str, str], secret: Path, model: Path, url: str) -> Path:
    """Write serve.json atomically (mode 0600: it names where the secret is). Its keys
    are the config keys a client sets from it."""
    path = directory / FILE
    tmp = directory / f".{FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "url": url, "security.cluster_secret_file": str(secret.resolve()),
                   "model.path": str(model.resolve()),
                   **{f"broker.{k}": addresses[k] for k in ("frontend", "stream_out", "stats")}}, f, indent=2)
    os.replace(tmp, path)
    return path


def withdraw(directory: Path) -> None:
    """Remove serve.json if this process wrote it."""
    path = directory / FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def find(directory: Path) -> dict | None:
    """The running serve's endpoints, or None when none is running from this directory."""
    try:
        info = json.loads((directory / FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if isinstance(info, dict) else None


def overrides(args, keys: dict[str, str], directory: Path) -> tuple[dict, str]:
    """Config overrides for a local client: each flag the user gave, else the running
    serve's value for it. Keys set in a config file or the environment win over serve's.

    ``keys`` maps a dotted config key to the attribute of ``args`` that sets it. Returns the
    overrides and a phrase for error messages that says where the endpoints came from.
    """
    given = {dotted: getattr(args, attr) for dotted, attr in keys.items()}
    configured = bool(args.config or os.environ.get("TANDEM_CONFIG"))
    info = None if configured else find(directory)
    if info is None:
        hint = (f"no running `tandem serve` found in {directory / FILE}; pass --state-dir, the broker's "
                "addresses and --cluster-secret-file" if not configured else "addresses from the config file")
        return given, hint
    for dotted in keys:
        env = "TANDEM_" + dotted.replace(".", "_").upper()
        if given[dotted] is None and env not in os.environ:
            given[dotted] = info.get(dotted)
    return given, f"addresses from the running `tandem serve` (pid {info['pid']}, {directory / FILE})"
