"""host_inputs on made-up drivers: each mode places the array's own bytes (its address and
size) and leaves its values alone; a driver without the call turns the mode off."""

import mlx.core as mx
import numpy as np
import pytest

from tandem.kernels.cuda import cuda_driver
from tandem.pipeline.runners.cuda import host_inputs


class RecordingDriver:
    def __init__(self, has=True):
        self._has, self.calls = has, []

    def has(self, name):
        return self._has

    def bind_context(self):
        pass

    def stream(self):
        self.calls.append(("stream",))
        return 42

    def prefetch_to_device(self, ptr, nbytes, stream):
        self.calls.append(("prefetch", ptr, nbytes, stream))

    def map_from_host(self, ptr, nbytes):
        self.calls.append(("map", ptr, nbytes))

    def call(self, name, *args):
        self.calls.append((name, *args))


def _placed(monkeypatch, mode, drv):
    monkeypatch.setattr(host_inputs, "MODE", mode)
    monkeypatch.setattr(host_inputs, "_placers", {})
    monkeypatch.setattr(cuda_driver, "driver", lambda: drv)
    host = np.arange(300, dtype=np.int32) * 7
    a = host_inputs.array(host)
    return host, a


def test_prefetch_moves_the_arrays_own_bytes_and_waits_for_them(monkeypatch):
    drv = RecordingDriver()
    host, a = _placed(monkeypatch, "prefetch", drv)
    assert np.array_equal(np.array(a), host)
    ptr = np.frombuffer(memoryview(a), np.uint8).ctypes.data
    assert drv.calls == [("stream",), ("prefetch", ptr, host.nbytes, 42), ("cuStreamSynchronize", 42)]
    host_inputs.array(host)  # a second array: the same stream, no new one
    assert [c[0] for c in drv.calls].count("stream") == 1


def test_prefetch_async_queues_the_move_and_does_not_wait(monkeypatch):
    drv = RecordingDriver()
    host, a = _placed(monkeypatch, "prefetch-async", drv)
    ptr = np.frombuffer(memoryview(a), np.uint8).ctypes.data
    assert drv.calls == [("stream",), ("prefetch", ptr, host.nbytes, 42)]
    assert np.array_equal(np.array(a), host)


def test_a_call_may_name_its_own_mode(monkeypatch):
    drv = RecordingDriver()
    host, _ = _placed(monkeypatch, "managed", drv)
    a = host_inputs.array(host, mode="mapped")
    assert drv.calls == [("map", np.frombuffer(memoryview(a), np.uint8).ctypes.data, host.nbytes)]


def test_mapped_advises_the_arrays_range_and_queues_nothing(monkeypatch):
    drv = RecordingDriver()
    host, a = _placed(monkeypatch, "mapped", drv)
    ptr = np.frombuffer(memoryview(a), np.uint8).ctypes.data
    assert drv.calls == [("map", ptr, host.nbytes)]
    assert np.array_equal(np.array(a), host)


def test_managed_and_no_driver_touch_nothing(monkeypatch):
    drv = RecordingDriver()
    host, a = _placed(monkeypatch, "managed", drv)
    assert drv.calls == [] and np.array_equal(np.array(a), host)
    _, a = _placed(monkeypatch, "prefetch", None)  # a CPU machine: MLX's array as it is
    assert np.array_equal(np.array(a), host)


def test_a_driver_without_the_call_falls_back_with_one_warning(monkeypatch, caplog):
    drv = RecordingDriver(has=False)
    with caplog.at_level("WARNING", logger="tandem.engine"):
        host, a = _placed(monkeypatch, "prefetch", drv)
        host_inputs.array(host)
    assert drv.calls == []
    assert sum("cuMemPrefetchAsync_v2" in r.getMessage() for r in caplog.records) == 1


def test_unknown_mode_is_refused_with_the_choices():
    assert host_inputs.parse_mode("mapped") == "mapped"
    with pytest.raises(ValueError, match="managed, prefetch, prefetch-async, mapped"):
        host_inputs.parse_mode("pinned")


def test_empty_array_is_left_alone(monkeypatch):
    drv = RecordingDriver()
    monkeypatch.setattr(host_inputs, "MODE", "prefetch")
    monkeypatch.setattr(host_inputs, "_placers", {})
    monkeypatch.setattr(cuda_driver, "driver", lambda: drv)
    a = host_inputs.array(np.zeros((0,), np.int32))
    assert a.size == 0 and drv.calls == []


class _Fn:
    """A stand-in libcuda entry point: records its arguments, returns CUDA_SUCCESS."""

    def __init__(self, log, name):
        self.log, self.name, self.argtypes, self.restype = log, name, None, None

    def __call__(self, *args):
        self.log.append((self.name, args))
        return 0


class _FakeLib:
    def __init__(self, optional=True):
        self.log = []
        names = [n for key in cuda_driver._SIGNATURES for n in ((key,) if isinstance(key, str) else key[:1])]
        names += list(cuda_driver._OPTIONAL) if optional else []
        for n in names:
            setattr(self, n, _Fn(self.log, n))


def test_driver_binds_the_optional_calls_only_where_they_exist():
    assert not cuda_driver.Driver(_FakeLib(optional=False)).has("cuMemPrefetchAsync_v2")
    lib = _FakeLib()
    drv = cuda_driver.Driver(lib)
    assert drv.has("cuMemPrefetchAsync_v2") and drv.has("cuMemAdvise_v2")
    drv.prefetch_to_device(0x7000, 2048, 5)
    name, (ptr, n, loc, flags, stream) = lib.log[-1]
    assert (name, ptr, n, flags, stream) == ("cuMemPrefetchAsync_v2", 0x7000, 2048, 0, 5)
    assert (loc.type, loc.id) == (cuda_driver.CU_MEM_LOCATION_TYPE_DEVICE, 0)
    drv.map_from_host(0x9000, 64)
    (n1, a1), (n2, a2) = lib.log[-2:]
    assert n1 == n2 == "cuMemAdvise_v2" and a1[:2] == a2[:2] == (0x9000, 64)
    assert (a1[2], a1[3].type) == (cuda_driver.CU_MEM_ADVISE_SET_PREFERRED_LOCATION, cuda_driver.CU_MEM_LOCATION_TYPE_HOST)
    assert (a2[2], a2[3].type, a2[3].id) == (cuda_driver.CU_MEM_ADVISE_SET_ACCESSED_BY,
                                            cuda_driver.CU_MEM_LOCATION_TYPE_DEVICE, 0)
