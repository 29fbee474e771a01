"""The KV budget of a worker that shares its device: a share of the device's memory, less
what the process already holds; never sized from host memory on a GPU."""

import mlx.core as mx
import pytest
from tandem.kvtypes import SamplingParams
from tandem.pipeline import budget
from tandem.pipeline.engine import Engine
from tandem.pipeline.runners import make_runner
from tandem.pipeline.settings import EngineSettings

GiB = 1 << 30


def test_auto_on_a_gpu_is_the_workers_share_less_what_it_holds(monkeypatch):
    monkeypatch.setattr(budget, "device_memory", lambda: 100 * GiB)
    monkeypatch.setattr(budget, "available_memory", lambda: 1 << 50)  # host memory must not count
    one = budget.num_blocks("auto", GiB // 1024, workers=1, in_use=10 * GiB)
    two = budget.num_blocks("auto", GiB // 1024, workers=2, in_use=10 * GiB)
    keep = 1 - budget.CACHE_FRACTION - budget.STEP_FRACTION  # MLX's buffer cache and a step's own buffers come out of the share too
    assert one == int(0.9 * 100 * 1024 * keep) - 10 * 1024
    assert two == int(0.9 * 50 * 1024 * keep) - 10 * 1024
    assert budget.num_blocks("auto", GiB, workers=2, in_use=80 * GiB) == 1  # nothing left: one block, no crash
    assert budget.num_blocks("2GiB", GiB // 1024, workers=2, in_use=10 * GiB) == 2048  # explicit sizes stand


def test_auto_on_the_cpu_splits_the_free_host_memory(monkeypatch):
    monkeypatch.setattr(budget, "device_memory", lambda: None)
    monkeypatch.setattr(budget, "available_memory", lambda: 8 * GiB)
    assert budget.num_blocks("auto", GiB // 1024, workers=1) == 4 * 1024
    assert budget.num_blocks("auto", GiB // 1024, workers=2) == 2 * 1024
    assert budget.share_bytes(2) is None


def test_the_pool_gets_what_the_runner_left_of_the_share(tiny, monkeypatch):
    """On a GPU the runner's own buffers (a dense copy of the weights, captured steps) come
    out of the share before the pool is sized, and MLX's limit is the share."""
    base = mx.get_active_memory()
    # 64 MiB of pool beside what the process holds, once the headroom is out of the share.
    share = int((base + 64 * 1024 * 1024) / (1 - budget.CACHE_FRACTION - budget.STEP_FRACTION))
    monkeypatch.setattr(budget, "share_bytes", lambda workers: share // workers)
    limits = []
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.append(n) or 0)
    caches = []
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: caches.append(n) or 0)
    kept = []

    def hungry(model, store, shape, settings):  # a runner that holds 16 MiB of its own
        kept.append(mx.zeros((4 * 1024 * 1024,), mx.float32))
        mx.eval(kept)
        return make_runner(model, store, shape, settings)

    lean = Engine(tiny, EngineSettings(workers_per_device=1), model_id="tiny")
    fat = Engine(tiny, EngineSettings(workers_per_device=1), model_id="tiny", runner_factory=hungry)
    halved = Engine(tiny, EngineSettings(workers_per_device=2), model_id="tiny")
    per = lean.bytes_per_block
    assert limits == [share, share, share // 2]
    assert caches == [budget.cache_bytes(n) for n in limits]  # freed buffers beyond it go back to the device
    # At least the runner's 16 MiB fewer blocks (more: the first engine's own arrays are held too).
    assert lean.pool.num_blocks - fat.pool.num_blocks >= 0.95 * (16 * 1024 * 1024 // per)
    assert halved.pool.num_blocks < lean.pool.num_blocks
    assert lean.store.num_blocks == lean.pool.num_blocks
    # The store grows as the pool fills (a growth releases the runner's pool arrays first).
    assert lean.store.capacity < lean.pool.num_blocks
    assert len(lean.generate_many([([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])[0]) == 3


def test_the_device_size_is_read_under_each_backends_key(monkeypatch):
    """MLX's CUDA backend says total_memory and free_memory, Metal memory_size; reading only
    the Metal key sized every CUDA worker from host memory."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 80 * GiB, "free_memory": 60 * GiB, "device_name": "x"})
    assert budget.device_memory() == 80 * GiB
    assert budget.device_free_memory() == 60 * GiB
    assert budget.share_bytes(2) == int(80 * GiB * budget.DEVICE_FRACTION / 2)
    monkeypatch.setattr(mx, "device_info", lambda: {"memory_size": 64 * GiB})
    assert budget.device_memory() == 64 * GiB
    assert budget.device_free_memory() is None
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert budget.device_memory() is None


def test_two_workers_on_one_gpu_plan_within_the_device(monkeypatch):
    """An 80 GB GPU, two workers each holding 22 GB of weights: their KV pools, caches and
    weights together stay inside the device's usable fraction."""
    monkeypatch.setattr(budget, "device_memory", lambda: 80 * GiB)
    per_block = 2 * 1024 * 1024
    weights = 22 * GiB
    blocks = budget.num_blocks("auto", per_block, workers=2, in_use=weights)
    share = budget.share_bytes(2)
    per_process = weights + blocks * per_block + budget.headroom_bytes(share)
    assert per_process <= share
    assert 2 * per_process <= budget.DEVICE_FRACTION * 80 * GiB
    assert blocks * per_block > 5 * GiB  # and the pool is not starved


def test_the_runner_lets_go_of_the_pools_before_the_store_grows(tiny):
    """A runner that keeps pool arrays beyond a step (the CUDA graph step) releases them
    first, so the old store goes layer by layer instead of living beside the new one."""
    events = []

    def spying(model, store, shape, settings):
        runner = make_runner(model, store, shape, settings)
        grow = store.ensure_capacity
        runner.release_pools = lambda: events.append(("release", store.capacity))
        store.ensure_capacity = lambda blocks: (events.append(("grow", store.capacity, blocks))
                                                if blocks > store.capacity else None, grow(blocks))[1]
        return runner

    eng = Engine(tiny, EngineSettings(kv_initial_tokens=0, block_size=16), model_id="tiny", runner_factory=spying)
    assert eng.store.capacity == 64
    prompts = [([5 + i] * 300, SamplingParams(max_tokens=2, ignore_eos=True)) for i in range(8)]
    assert all(len(t) == 2 for t in eng.generate_many(prompts))
    grows = [i for i, e in enumerate(events) if e[0] == "grow"]
    assert grows and eng.store.capacity > 64
    assert all(i > 0 and events[i - 1][0] == "release" for i in grows)


def test_a_step_that_runs_out_of_device_memory_fails_its_requests_and_the_engine_goes_on(tiny, monkeypatch):
    """MLX fails an allocation while evaluating a step: that step's requests end with an
    error naming it, their blocks go back to the pool, and the next request is served."""
    import threading

    assert budget.out_of_memory(RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"))
    assert budget.out_of_memory(RuntimeError("[malloc] Unable to allocate 4096 bytes."))
    assert not budget.out_of_memory(RuntimeError("shape mismatch")) and not budget.out_of_memory(MemoryError())
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny")
    real = mx.async_eval
    armed = threading.Event()

    def failing(*arrays):
        if armed.is_set() and threading.current_thread() is eng._thread:
            armed.clear()
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", failing)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    armed.set()
    with pytest.raises(RuntimeError, match="out of device memory"):
        eng.generate_many([([5, 6, 7, 8], sp), ([9, 10, 11], sp)])
    assert not armed.is_set()
    assert [len(t) for t in eng.generate_many([([5, 6, 7, 8], sp)])] == [4]
    st = eng.stats()
    assert st.running == 0 and st.free_blocks == st.total_blocks
    eng.pool.check()


def test_a_share_that_leaves_no_room_for_kv_says_so(tiny, monkeypatch, caplog):
    """Workers packed onto a device too small for them start (each request then fails on
    its own), but the log says why and what to change."""
    import logging

    monkeypatch.setattr(budget, "share_bytes", lambda workers: mx.get_active_memory() // 2)
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: 0)
    monkeypatch.setattr(mx, "set_cache_limit", lambda n: 0)
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        eng = Engine(tiny, EngineSettings(workers_per_device=2), model_id="tiny")
    assert eng.pool.num_blocks == 1
    assert any("workers_per_device" in r.getMessage() and "share of the GPU" in r.getMessage() for r in caplog.records)
