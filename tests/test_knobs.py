"""The knob registry is the only way a TANDEM_* environment variable gets into tandem."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem import config, knobs

ROOT = Path(__file__).resolve().parents[1] / "tandem"
NAME = re.compile(r"TANDEM_[A-Z0-9_]*[A-Z0-9]")
# Not environment variables: a C macro in the captured kernels' prelude.
NOT_ENVIRONMENT = {"TANDEM_MAX_NDIM"}


def _typed_names() -> set[str]:
    return {"TANDEM_" + dotted.replace(".", "_").upper() for dotted in config._all_keys(config.Config())}


def _names_in_source() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*")):
        if path.suffix not in (".py", ".c", ".h", ".cu", ".cuh") or not path.is_file():
            continue
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT.parent)))
    return found


def test_every_name_in_the_package_is_a_knob_or_a_typed_setting():
    allowed = set(knobs.KNOBS) | set(knobs.CONFIG_NAMES) | _typed_names() | NOT_ENVIRONMENT
    stray = {name: sorted(set(files)) for name, files in _names_in_source().items() if name not in allowed}
    assert not stray, f"declare these in tandem/knobs.py or make them typed settings: {stray}"


def test_the_registry_stays_small_and_says_why():
    assert len(knobs.KNOBS) <= knobs.LIMIT == 15
    for name, knob in knobs.KNOBS.items():
        assert name == knob.name and name.startswith("TANDEM_") and knob.why.strip(), name
        assert name not in _typed_names(), f"{name} shadows a typed setting"
        knob.parse(name, knob.default)  # every default parses


def test_a_knob_is_read_through_the_registry_only():
    """A direct ``os.environ`` read of a knob would skip its parser; the typed
    configuration's names (``TANDEM_CONFIG`` and the like) are read where they are needed."""
    reads = re.compile(r"os\.(?:environ(?:\.get)?|getenv)\s*[\[(]\s*[\"'](TANDEM_[A-Z0-9_]+)")
    direct = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "knobs.py":
            for name in reads.findall(path.read_text()):
                if name in knobs.KNOBS:
                    direct.setdefault(name, []).append(str(path.relative_to(ROOT.parent)))
    assert not direct, direct


def test_knobs_are_read_when_used(monkeypatch):
    monkeypatch.delenv("TANDEM_PAGED_KERNELS", raising=False)
    assert knobs.PAGED_KERNELS == "auto"
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "Reference")
    assert knobs.PAGED_KERNELS == "reference"
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "fast")
    with pytest.raises(ValueError, match="TANDEM_PAGED_KERNELS='fast': use one of auto, off, cuda, reference"):
        knobs.PAGED_KERNELS
    monkeypatch.setenv("TANDEM_ATTENTION_THREADS", "0")
    with pytest.raises(ValueError, match="TANDEM_ATTENTION_THREADS"):
        knobs.ATTENTION_THREADS
    assert knobs.read("TANDEM_ATTENTION_THREADS", {"TANDEM_ATTENTION_THREADS": "3"}) == 3
    assert knobs.read("TANDEM_BLAS", {"TANDEM_BLAS": " "}) == "auto"  # empty: the default
    with pytest.raises(AttributeError):
        knobs.NO_SUCH_KNOB
