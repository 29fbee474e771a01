"""docs/protocol.md is the spec: its message tables must match the code."""

from __future__ import annotations

import re
from pathlib import Path

from tandem.wire import protocol as P
from tandem.wire.messages import REGISTRY

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_doc_tables_match_messages():
    text = DOC.read_text()
    assert f"version {P.PROTOCOL_VERSION}" in text.splitlines()[0]
    for msg_type, cls in REGISTRY.items():
        heading = f"#### {msg_type.name} = {int(msg_type)} (`{cls.__name__}`)"
        assert heading in text, heading
        section = text.split(heading, 1)[1].split("####", 1)[0]
        documented = re.findall(r"^\| (\d+) \| `(\w+)` \|", section, flags=re.M)
        assert [(int(i), name) for i, name in documented] == [(i, name) for i, (name, _) in enumerate(cls.SPECS)]
