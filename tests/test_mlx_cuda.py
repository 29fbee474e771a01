"""tandem sets MLX's CUDA graph byte limit at import, unless the environment says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SNIPPET = "import os, tandem; print(os.environ.get('MLX_MAX_MB_PER_BUFFER'), sorted(tandem.MLX_CUDA_SETTINGS))"


def _run(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("MLX_MAX_MB_PER_BUFFER", "TANDEM_MLX_GRAPHS")}
    out = subprocess.run([sys.executable, "-c", SNIPPET], env={**base, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("env, expected", [
    ({}, "100000 ['MLX_MAX_MB_PER_BUFFER']"),
    ({"MLX_MAX_MB_PER_BUFFER": "7"}, "7 []"),  # the user's value wins
    ({"TANDEM_MLX_GRAPHS": "default"}, "None []"),  # MLX's own limits
])
def test_import_sets_the_byte_limit_only_where_the_environment_is_silent(env, expected):
    assert _run(**env) == expected
