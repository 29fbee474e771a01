"""The KV budget of a worker that shares its device: a share of the device's memory, less
what the process already holds; never sized from host memory on a GPU."""

import mlx.core as mx
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
    assert one == int(0.9 * 100 * 1024) - 10 * 1024
    assert two == int(0.9 * 50 * 1024) - 10 * 1024
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
    share = base + 64 * 1024 * 1024
    monkeypatch.setattr(budget, "share_bytes", lambda workers: share // workers)
    limits = []
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: limits.append(n) or 0)
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
    # At least the runner's 16 MiB fewer blocks (more: the first engine's own arrays are held too).
    assert lean.pool.num_blocks - fat.pool.num_blocks >= 0.95 * (16 * 1024 * 1024 // per)
    assert halved.pool.num_blocks < lean.pool.num_blocks
    assert lean.store.num_blocks == lean.pool.num_blocks
    assert len(lean.generate_many([([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])[0]) == 3
