"""One typed configuration: defaults < TOML file < environment < flags.

Each package owns the dataclass for its own section (``tandem/<pkg>/settings.py``);
this module only layers the sources and validates. A field's ``metadata`` may carry
``min``, ``max``, ``choices`` and ``help``; a bad value raises :class:`ConfigError`
naming the key, the value and what is allowed.

TOML keys are ``[section] key = value``; environment variables are
``TANDEM_<SECTION>_<KEY>`` (for example ``TANDEM_ENGINE_PARALLEL=16``); flags
arrive as ``{"section.key": value}`` from the CLI.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tandem.broker.settings import BrokerSettings
from tandem.http.settings import EdgeSettings
from tandem.pipeline.settings import EngineSettings, ModelSettings, SpeculativeSettings
from tandem.wire.settings import SecuritySettings, TransferSettings
from tandem.workers.settings import WorkerSettings


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says how to fix it."""


@dataclass
class Config:
    model: ModelSettings = field(default_factory=ModelSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)


def load(
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from every source, highest priority last."""
    env = os.environ if env is None else env
    config = Config()
    path = path or env.get("TANDEM_CONFIG") or None
    if path:
        for dotted, value in _read_toml(Path(path)).items():
            _assign(config, dotted, value, source=f"{path}")
    for dotted in _all_keys(config):
        name = "TANDEM_" + dotted.replace(".", "_").upper()
        if name in env:
            _assign(config, dotted, env[name], source=f"${name}", from_text=True)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _assign(config, dotted, value, source="command line")
    return config


def describe(config: Config) -> dict[str, dict[str, Any]]:
    """The effective configuration as plain dicts (for logs and `--print-config`)."""
    return dataclasses.asdict(config)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give the TOML file itself") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user (uid {os.getuid()}); "
                          "the services run as user tandem: chgrp tandem it and chmod 0640") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
        for key, value in table.items():
            flat[f"{section}.{key}"] = value
    return flat


def _all_keys(config: Config) -> list[str]:
    return [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, section.name))
    ]


def _assign(config: Config, dotted: str, value: Any, source: str, from_text: bool = False) -> None:
    section_name, _, key = dotted.partition(".")
    section = getattr(config, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        sections = ", ".join(f.name for f in dataclasses.fields(config))
        raise ConfigError(f"{source}: unknown section {section_name!r} (sections: {sections})")
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(
            f"{source}: unknown key {dotted!r} (keys in [{section_name}]: {', '.join(fields)})"
        )
    f = fields[key]
    hints = typing.get_type_hints(type(section))
    setattr(section, key, coerce(dotted, value, hints[key], f.metadata, source, from_text))


def coerce(dotted: str, value: Any, hint: Any, meta: Mapping[str, Any], source: str, from_text: bool) -> Any:
    """Convert ``value`` to ``hint`` and check the field's bounds."""
    allowed_none = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        allowed_none = len(args) < len(typing.get_args(hint))
        hint = args[0]
    where = f"{source}: {dotted}={value!r}"
    if allowed_none and (value is None or (from_text and str(value).lower() in ("", "none"))):
        return None
    try:
        if hint is bool:
            if isinstance(value, bool):
                out = value
            elif str(value).lower() in ("1", "true", "yes", "on"):
                out = True
            elif str(value).lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError
        elif hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            out = int(value)
        elif hint is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        elif hint is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            out = str(value)
        elif typing.get_origin(hint) in (list, tuple):
            items = value.split(",") if isinstance(value, str) else list(value)
            out = [str(v).strip() for v in items if str(v).strip()]
        else:
            out = value
    except (TypeError, ValueError):
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{where} is not a valid {name}" + (" (or none)" if allowed_none else "")) from None
    choices = meta.get("choices")
    if choices is not None and out not in choices:
        raise ConfigError(f"{where} is not allowed; choose one of: {', '.join(map(str, choices))}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and out < lo:
        raise ConfigError(f"{where} is too small; the minimum is {lo}")
    if hi is not None and out > hi:
        raise ConfigError(f"{where} is too large; the maximum is {hi}")
    return out


def render_example(config: Config | None = None) -> str:
    """Every setting with its default and help text, as a commented TOML file.

    ``ops/tandem.toml.example`` is this output; a test keeps the two in step.
    """
    config = config or Config()
    lines = [
        "# tandem configuration: every key with its default. Precedence: this file <",
        "# TANDEM_<SECTION>_<KEY> environment variables < command-line flags.",
    ]
    for section in dataclasses.fields(config):
        lines += ["", f"[{section.name}]"]
        obj = getattr(config, section.name)
        for f in dataclasses.fields(obj):
            meta = f.metadata
            note = meta.get("help", "")
            if "choices" in meta:
                note += f" (one of: {', '.join(map(str, meta['choices']))})"
            if note:
                lines.append(f"# {note}")
            value = getattr(obj, f.name)
            lines.append(f"# {f.name} = (unset)" if value is None else f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
