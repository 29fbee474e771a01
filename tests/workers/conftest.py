from __future__ import annotations

import pytest
import zmq


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, destroyed (no linger) after it."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)
