"""Every environment variable tandem reads outside its typed configuration, in one place.

Settings belong in the typed configuration (``tandem/config.py`` and the per-package
``settings.py``; ``ops/tandem.toml.example`` lists every key), where each can also be set
as ``TANDEM_<SECTION>_<KEY>``, and where ``TANDEM_CONFIG`` names the TOML file. The
cluster secret comes from ``TANDEM_CLUSTER_SECRET_FILE`` or ``TANDEM_CLUSTER_SECRET``
(``tandem/wire/secret.py``), never from a file the configuration names in the clear.
What is left is here: things an operator needs before the configuration exists (the
BLAS and malloc choices are made at ``import tandem``), a workaround for a faulty
backend, paths, and switches for the benchmarks' instruments. Each is declared once with
its default, its parser and why it exists, and read when used (``knobs.NAME`` evaluates
the environment at that moment), in the style of vLLM's ``envs.py``.

No variant of the engine that lost its measurement is selectable here: those were deleted
with their code, and tuned numbers are module constants (the benchmarks patch them through
``bench/_common.Patches``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Knob:
    name: str  # the environment variable
    default: str
    parse: Callable[[str, str], Any]  # (name, text) -> value; raises ValueError naming the variable
    why: str  # one line: what it is for, and why it is not a typed setting


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError(f"{name}={text!r}: use one of {', '.join(options)}")
        return value
    return parse


def _text(name: str, text: str) -> str:
    return text


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={text!r}: use 1 or 0")


def _threads(name: str, text: str) -> int | None:
    value = text.strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={text!r}: set a whole number of threads, 1 or more")
    return int(value)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("TANDEM_BLAS", "auto", _choice("auto", "mkl", "reference"),
         "the CPU BLAS mlx binds at `import tandem`, before any configuration is read (tandem/_blas.py)"),
    Knob("TANDEM_PREFILL_BLAS", "auto", _choice("auto", "mkl", "mlx", "off", "0"),
         "CPU prefill products through numpy's OpenBLAS (auto) or mlx/MKL, which may win on Intel CPUs"),
    Knob("TANDEM_MALLOC", "", _choice("", "default"),
         "`default` leaves glibc's malloc as it is; set at `import tandem`, before any thread allocates"),
    Knob("TANDEM_MLX_GRAPHS", "", _choice("", "default"),
         "`default` leaves MLX's CUDA graph limits as they are; set at `import tandem`, before MLX reads them"),
    Knob("TANDEM_PAGED_KERNELS", "auto", _choice("auto", "off", "cuda", "reference"),
         "the CUDA runner: off works around a fault in tandem's kernels; reference runs their pure-mx twins (tests)"),
    Knob("TANDEM_KERNEL_DIR", "", _text,
         "where CUDA kernel texts and cubins are cached (the systemd units point it at /var/cache)"),
    Knob("TANDEM_ATTENTION_THREADS", "", _threads,
         "threads of the CPU C kernels (unset: one per core), for a host shared with other work"),
    Knob("TANDEM_TIMELINE", "", _text,
         "a worker appends a per-request timeline to this file (bench/disagg.py's TTFT breakdown)"),
    Knob("TANDEM_GRAPH_TIMING", "0", _flag,
         "time every captured one-row step on the device (bench/gpu_decode.py); costs two events a step"),
    Knob("TANDEM_EDGE_ACCESS_LOG", "", _flag,
         "`tandem edge --access-log` hands it to the gunicorn config it starts (tandem/http/gunicorn_conf.py)"),
    Knob("TANDEM_EDGE_LOG_LEVEL", "info", _text,
         "gunicorn's log level, for the same hand-over"),
)}

LIMIT = 15
"""Most names the registry may hold (tests/test_knobs.py)."""

CONFIG_NAMES = ("TANDEM_CONFIG", "TANDEM_CLUSTER_SECRET", "TANDEM_CLUSTER_SECRET_FILE")
"""Names of the typed configuration's own story (above), not knobs; with every
``TANDEM_<SECTION>_<KEY>`` of ``tandem/config.py``."""


def read(name: str, env=None) -> Any:
    """The parsed value of knob ``name`` from ``env`` (default: the process environment, now)."""
    knob = KNOBS[name]
    text = (os.environ if env is None else env).get(name)
    return knob.parse(name, knob.default if text is None or not text.strip() else text)


def __getattr__(attr: str) -> Any:
    # ``knobs.BLAS`` reads TANDEM_BLAS at the moment of the access.
    name = "TANDEM_" + attr
    if name in KNOBS:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + [n[len("TANDEM_"):] for n in KNOBS])
