"""The layered config: defaults < TOML < environment < flags, with errors that say what to fix."""

from __future__ import annotations

import pytest

from tandem import config
from tandem.pipeline.settings import EngineSettings
from tandem.config import ConfigError


def write(tmp_path, text):
    p = tmp_path / "tandem.toml"
    p.write_text(text)
    return p


def test_defaults():
    c = config.load(env={})
    assert c.engine.parallel is None and c.broker.strategy == "least_loaded" and c.model.path is None
    # Unset, parallel is the backend's: 16 on the CPU, 128 on a GPU; a set value stands.
    assert EngineSettings().resolve(on_cpu=True).parallel == 16
    assert EngineSettings().resolve(on_cpu=False).parallel == 128
    assert EngineSettings(parallel=8).resolve(on_cpu=False).parallel == 8


def test_each_layer_overrides_the_one_below(tmp_path):
    path = write(tmp_path, "[engine]\nparallel = 8\nblock_size = 32\nmax_queue_depth = 5\n")
    env = {"TANDEM_ENGINE_BLOCK_SIZE": "64", "TANDEM_ENGINE_MAX_QUEUE_DEPTH": "7"}
    c = config.load(path, env=env, overrides={"engine.max_queue_depth": 9, "engine.parallel": None})
    assert c.engine.parallel == 8  # TOML; a None flag means "not given"
    assert c.engine.block_size == 64  # environment beats TOML
    assert c.engine.max_queue_depth == 9  # flag beats environment


def test_config_path_from_environment(tmp_path):
    path = write(tmp_path, "[broker]\nstrategy = 'round_robin'\n")
    assert config.load(env={"TANDEM_CONFIG": str(path)}).broker.strategy == "round_robin"


@pytest.mark.parametrize(
    "env,message",
    [
        ({"TANDEM_ENGINE_PARALLEL": "many"}, "$TANDEM_ENGINE_PARALLEL: engine.parallel='many' is not a valid int"),
        ({"TANDEM_ENGINE_PARALLEL": "0"}, "engine.parallel='0' is too small; the minimum is 1"),
        ({"TANDEM_BROKER_STRATEGY": "random"}, "choose one of: round_robin, least_loaded"),
        ({"TANDEM_ENGINE_ENABLE_PREEMPTION": "perhaps"}, "is not a valid bool"),
    ],
)
def test_bad_environment_values_name_key_value_and_allowed(env, message):
    with pytest.raises(ConfigError) as exc:
        config.load(env=env)
    assert message in str(exc.value)


def test_types_parse_from_text():
    c = config.load(env={
        "TANDEM_ENGINE_ENABLE_PREEMPTION": "off",
        "TANDEM_ENGINE_MAX_BATCH_PREFILL_TOKENS": "none",
        "TANDEM_SECURITY_DECODE_ALLOWLIST": "node-a, node-b",
    })
    assert c.engine.enable_preemption is False
    assert c.engine.max_batch_prefill_tokens is None
    assert c.security.decode_allowlist == ["node-a", "node-b"]


@pytest.mark.parametrize(
    "text,message",
    [
        ("[engine]\nparalel = 3\n", "unknown key 'engine.paralel'"),
        ("[engin]\nparallel = 3\n", "unknown section 'engin'"),
        ("[engine]\nparallel = 2.5\n", "engine.parallel=2.5 is not a valid int"),
        ("[engine]\nparallel = true\n", "is not a valid int"),
        ("parallel = 3\n", "must be a [section] table"),
        ("[engine\n", "is not valid TOML"),
    ],
)
def test_bad_toml_is_reported_with_the_file(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        config.load(path, env={})
    assert message in str(exc.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml", env={})


def test_a_config_that_is_a_directory_is_one_line_from_the_command(tmp_path):
    """/etc/tandem/tandem.toml made as a directory: one line and exit 2, no traceback (#45)."""
    import subprocess
    import sys

    (tmp_path / "tandem.toml").mkdir()
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "stats", "--config", str(tmp_path / "tandem.toml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tandem stats: config file {tmp_path / 'tandem.toml'} is a directory; give the TOML file itself"


def test_an_unreadable_config_names_the_user_and_the_fix(tmp_path, monkeypatch):
    # Tests may run as root, whom file modes do not stop: make the read itself fail.
    path = write(tmp_path, "[engine]\nparallel = 2\n")

    def denied(self, *a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "read_text", denied)
    with pytest.raises(ConfigError, match=r"not readable by this user .*chgrp tandem"):
        config.load(path, env={})


def test_broker_prompt_limit_is_reachable_on_the_wire():
    """A broker limit above the protocol's bound would refuse long prompts as malformed instead."""
    from tandem.wire.protocol import MAX_PROMPT_TOKENS

    assert config.load(env={}).broker.max_prompt_tokens == MAX_PROMPT_TOKENS
    with pytest.raises(ConfigError, match="the maximum is 131072"):
        config.load(env={"TANDEM_BROKER_MAX_PROMPT_TOKENS": str(MAX_PROMPT_TOKENS + 1)})
