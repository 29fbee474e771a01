"""A 4-bit checkpoint loaded ``auto`` on the CPU stays packed (no dense copy of its
projections) and gives the tokens the dense fp32 load gives at temperature 0: decode
through the C step at any batch size, prefills of few tokens multiplied from the codes,
larger ones through OpenBLAS a block of expanded rows at a time."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tandem.kernels.cpu import q4_kernels
from tandem.kvtypes import SamplingParams
from tandem.pipeline import loader
from tandem.pipeline.engine import Engine
from tandem.pipeline.runners.cpu import fast_llama, native_decode
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, random_prompts

pytestmark = pytest.mark.skipif(not q4_kernels.available(), reason="no AVX-512 C kernels: auto dequantizes")


@pytest.fixture(scope="module")
def packed(tiny_quantized_model_dir):
    return loader.load_model(tiny_quantized_model_dir, "auto")


@pytest.fixture(scope="module")
def dense(tiny_quantized_model_dir):
    return loader.load_model(tiny_quantized_model_dir, "dense")


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineSettings(kv_cache_budget="32MiB", **kw), model_id="q", eos_token_ids=[EOS])


def _requests(n: int, lo: int, hi: int, seed: int):
    prompts = random_prompts(n, lo, hi, seed=seed)
    return [(p, SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True)) for i, p in enumerate(prompts)]


def test_auto_keeps_a_4_bit_checkpoint_packed(packed):
    assert loader.packed_only(packed.model) and "packed" in packed.weights
    layer = packed.model.model.layers[0]
    assert type(layer.mlp.down_proj) is nn.QuantizedLinear  # no dense copy was made
    fast = _engine(packed.model).runner.fast
    assert fast is not None and fast.packed and fast.native is not None and fast.fused is None


@pytest.mark.parametrize("n,lo,hi,batch", [(6, 2, 9, 3),     # prefills under BLAS_ROWS_FROM tokens: codes direct
                                           (5, 40, 120, 4)])  # from it: expanded into the buffer, OpenBLAS
def test_packed_and_dense_give_the_same_tokens(packed, dense, monkeypatch, n, lo, hi, batch):
    expanded = []
    real = q4_kernels.blas_rows
    monkeypatch.setattr(q4_kernels, "blas_rows", lambda sg, w, *a, **kw: expanded.append(
        isinstance(w, q4_kernels.Q4Matrix)) or real(sg, w, *a, **kw))
    reqs = _requests(n, lo, hi, seed=n + lo)
    got = _engine(packed.model, max_batch_prefill=batch).generate_many(reqs)
    assert any(expanded) == (lo * batch >= fast_llama.BLAS_ROWS_FROM)
    assert got == _engine(dense.model, max_batch_prefill=batch).generate_many(reqs)


def test_packed_decode_takes_the_c_step_beyond_the_dense_row_limit(packed, dense, monkeypatch):
    monkeypatch.setattr(native_decode, "MAX_ROWS", 2)
    calls = []
    real = q4_kernels.decode_step
    monkeypatch.setattr(q4_kernels, "decode_step", lambda *a, **kw: calls.append(a[3].shape[0]) or real(*a, **kw))
    reqs = _requests(5, 3, 30, seed=4)
    got = _engine(packed.model, max_batch_prefill=5).generate_many(reqs)
    assert max(calls) > 2
    assert got == _engine(dense.model, max_batch_prefill=5).generate_many(reqs)


def test_without_the_decode_mirror_packed_decode_runs_on_the_host_layers(packed, dense):
    reqs = _requests(4, 3, 40, seed=9)
    got = _engine(packed.model, decode_mirror=False).generate_many(reqs)
    assert got == _engine(dense.model).generate_many(reqs)


def test_with_the_kernels_off_the_packed_model_goes_dense(tiny_quantized_model_dir, dense):
    lm = loader.load_model(tiny_quantized_model_dir, "auto")
    eng = _engine(lm.model, native_kernels=False)
    assert not loader.packed_only(lm.model) and type(lm.model.model.layers[0].mlp.down_proj) is nn.Linear
    reqs = _requests(3, 3, 20, seed=2)
    assert eng.generate_many(reqs) == _engine(dense.model).generate_many(reqs)


@pytest.mark.parametrize("bits,table", [(4, True), (4, False), (8, True)])
@pytest.mark.parametrize("transposed", [False, True])
def test_blas_rows_of_a_packed_matrix_is_the_product_of_its_values(bits, table, transposed, monkeypatch):
    import mlx.core as mx
    import numpy as np

    from tandem import _blas

    sgemm = _blas.openblas_sgemm()
    if sgemm is None:
        pytest.skip("no OpenBLAS sgemm")
    rng = np.random.default_rng(bits)
    wq, s, b = mx.quantize(mx.array(rng.normal(size=(200, 320)).astype(np.float16)), group_size=64, bits=bits)
    m = q4_kernels.Q4Matrix.from_mlx(np.array(wq), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)),
                                     64, True, table=table)
    monkeypatch.setattr(q4_kernels, "PACKED_BLOCK_BYTES", 16 * 320 * 4)  # many blocks of 16 rows, a short last one
    x = rng.normal(size=(70, 320) if transposed else (320, 70)).astype(np.float32)
    dense = m.expand()
    want = q4_kernels.blas_rows(sgemm, dense, x, transposed)
    # the values are the same; OpenBLAS may order a block's sums by its row count
    np.testing.assert_allclose(q4_kernels.blas_rows(sgemm, m, x, transposed), want, rtol=1e-5, atol=1e-4)
    acc = np.ones_like(want)
    q4_kernels.blas_rows(sgemm, m, x, transposed, add_to=acc)
    np.testing.assert_allclose(acc, want + 1, rtol=1e-5, atol=1e-4)


def test_codes_that_do_not_expand_to_mlx_values_send_the_model_dense(tiny_quantized_model_dir, dense, monkeypatch):
    lm = loader.load_model(tiny_quantized_model_dir, "auto")
    real = loader.PackedModules.dense
    monkeypatch.setattr(loader.PackedModules, "dense", lambda self, name, rows=None: real(self, name, rows) * 1.01)
    eng = _engine(lm.model)
    assert not loader.packed_only(lm.model) and eng.runner.fast.native is not None  # dense, and its own check passed
    reqs = _requests(3, 3, 20, seed=3)
    assert eng.generate_many(reqs) == _engine(dense.model).generate_many(reqs)


def test_without_the_table_a_4_bit_matrix_holds_three_quarters_of_a_byte_a_weight():
    import mlx.core as mx
    import numpy as np

    wq, s, b = mx.quantize(mx.array(np.random.default_rng(0).normal(size=(64, 256)).astype(np.float16)), 64, 4)
    args = (np.array(wq), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), 64, True)
    lean, tabled = (q4_kernels.Q4Matrix.from_mlx(*args, table=t) for t in (False, True))
    assert lean.nbytes == 64 * 256 * 3 // 4 and lean.values16 is None and lean.lut is None
    assert tabled.nbytes == 64 * 256 * 3 // 2  # codes and the fp16 table of 16 values per 32 weights
    assert np.array_equal(lean.expand(), tabled.expand())


def test_stats_report_the_decode_mirrors_memory(packed):
    """Heartbeats carry ``kv_mirror_bytes`` so a worker's memory net of it shows a leak: it
    is the memory the decode mirror's buffers hold (what dropping them gives back to MLX),
    and it grows to the largest batch x context decoded, then stays."""
    eng = _engine(packed.model)
    eng.start()
    try:
        eng.generate_many([(p, SamplingParams(temperature=0.0, max_tokens=8)) for p in random_prompts(2, 10, 20, seed=11)])
        small = eng.stats().kv_mirror_bytes
        eng.generate_many([(p, SamplingParams(temperature=0.0, max_tokens=8)) for p in random_prompts(4, 150, 200, seed=12)])
        large = eng.stats().kv_mirror_bytes
        eng.generate_many([(p, SamplingParams(temperature=0.0, max_tokens=8)) for p in random_prompts(2, 10, 20, seed=13)])
        assert 0 < small < large == eng.stats().kv_mirror_bytes
        before = mx.get_active_memory()
    finally:
        eng.stop()  # the engine thread's end drops the mirror (quiesce)
    freed = before - mx.get_active_memory()
    assert large <= freed < large + (64 << 10)  # the mirror, and a step's few small arrays


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-q4-untied"), quantize=True, tie=False)


class EveryOtherDrafter:
    """Proposes the recorded greedy continuation on every other call: verifying steps and
    plain decode steps of one row alternate."""

    cost = 0.0

    def __init__(self, prompt, output):
        self.prompt, self.output, self.calls = prompt, output, 0

    def propose(self, seq, k):
        self.calls += 1
        done = len(seq.tokens) - seq.prompt_len
        return self.output[done: done + k] if self.calls % 2 else []

    def drop(self, serial):
        pass


def test_packed_decode_after_verifying_gives_the_dense_tokens(untied_dir):
    # After a verifying step the engine hands the one-row step host (numpy) ids; an untied
    # 4-bit embedding (mlx indexes by mlx arrays only) must take them.
    from tandem.pipeline.speculation import Speculator, StepTimes

    packed, dense = loader.load_model(untied_dir, "auto"), loader.load_model(untied_dir, "dense")
    prompt = [5, 6, 7, 8, 9] * 6
    reqs = [(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    want = _engine(dense.model).generate_many(reqs)
    drafter = EveryOtherDrafter(prompt, want[0])
    eng = Engine(packed.model, EngineSettings(kv_cache_budget="32MiB"), model_id="q", eos_token_ids=[EOS],
                 speculator=Speculator(drafter, times=StepTimes(0.0, measured=False)))
    assert eng.generate_many(reqs) == want
    assert drafter.calls > 2
