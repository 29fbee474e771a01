"""The KV address a decode worker advertises for a wildcard bind (issue #45 item 1)."""

from __future__ import annotations

import pytest

from tandem.workers import advertise
from tandem.workers.advertise import AdvertiseError, advertised


def test_a_concrete_bind_is_advertised_as_bound():
    assert advertised("tcp://10.1.2.3:5600", "", "tcp://10.1.2.1:5556") == "tcp://10.1.2.3:5600"


@pytest.mark.parametrize("explicit,want", [
    ("10.0.0.5", "tcp://10.0.0.5:5600"),
    ("tcp://10.0.0.5", "tcp://10.0.0.5:5600"),
    ("tcp://10.0.0.5:7000", "tcp://10.0.0.5:7000"),
    ("gpu-7.example", "tcp://gpu-7.example:5600"),
    ("fd00::7", "tcp://[fd00::7]:5600"),
])
def test_kv_advertise_wins(explicit, want):
    assert advertised("tcp://0.0.0.0:5600", explicit, "tcp://127.0.0.1:5556") == want


@pytest.mark.parametrize("bound", ["tcp://0.0.0.0:5600", "tcp://*:5600"])
def test_a_wildcard_bind_advertises_the_address_that_reaches_the_broker(bound):
    assert advertised(bound, "", "tcp://127.0.0.1:5556") == "tcp://127.0.0.1:5600"


def test_no_route_to_the_broker_refuses_and_names_the_setting(monkeypatch):
    def unreachable(peer):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(advertise, "route_source", unreachable)
    with pytest.raises(AdvertiseError, match="worker.kv_advertise"):
        advertised("tcp://0.0.0.0:5600", "", "tcp://10.9.9.9:5556")
    with pytest.raises(AdvertiseError, match="wildcard"):
        advertised("tcp://0.0.0.0:5600", "0.0.0.0", "tcp://10.9.9.9:5556")
