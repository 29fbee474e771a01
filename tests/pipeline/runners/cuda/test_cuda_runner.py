"""The CUDA runner's wiring: fused blocks, decode over the store's pools, engine == alone.

On machines without CUDA the runner runs with the kernels' pure-mx references
(``ops="reference"``): the fused QKV / gate-up weights, the decode forward that bypasses
mlx-lm's model code, the block table / slot / length bookkeeping and the switch between
the decode path and the portable prefill path are all exercised; only the two CUDA
kernels are swapped for their references (tests/kernels test those on the GPU).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kvtypes import SamplingParams
from tandem.pipeline.runners.cuda import runner as cuda_runner
from tandem.pipeline.engine import Engine
from tandem.pipeline.runners.cpu.runner import CpuRunner
from tandem.pipeline.runners.portable.paged import PagedRunner
from tandem.pipeline.settings import EngineSettings
from tandem.kernels.cuda.quantized_matmul import cuda_available
from tests.pipeline.conftest import EOS, oracle, random_prompts
from tests.pipeline.test_engine import greedy

MAX_TOKENS = 12


def _fresh(path):
    # The kernel runner rewrites the model's layers: each engine gets its own copy.
    from mlx_lm import load

    model, _ = load(str(path))
    return model


def _engine(model, **kw) -> Engine:
    kw.setdefault("kv_cache_budget", "16MiB")
    return Engine(model, EngineSettings(**kw), model_id="tiny", eos_token_ids=[EOS])


@pytest.fixture(scope="module")
def expected(tiny):
    prompts = random_prompts(9, 1, 70, seed=11)
    return prompts, [oracle(tiny, p, MAX_TOKENS) for p in prompts]


def test_cpu_keeps_the_cpu_runner(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TANDEM_PAGED_KERNELS", raising=False)
    eng = _engine(_fresh(tiny_model_dir))
    if not cuda_available():
        assert type(eng.runner) is CpuRunner
    else:
        assert isinstance(eng.runner, cuda_runner.KernelRunner)


def test_unknown_mode_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "fast")
    with pytest.raises(ValueError, match="TANDEM_PAGED_KERNELS"):
        _engine(_fresh(tiny_model_dir))


@pytest.mark.parametrize("config", [
    dict(),  # ragged batch: rows of different lengths decode together
    dict(block_size=4, max_batch_size=3, parallel=6, prefill_chunk_size=16),
    dict(enable_prefix_caching=True, max_batch_prefill=1),
    dict(max_batch_size=1),  # one-row steps: each layer's tail computes the next layer's QKV
])
def test_reference_kernel_runner_matches_alone(tiny_model_dir, expected, monkeypatch, config):
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts, want = expected
    eng = _engine(_fresh(tiny_model_dir), **config)
    assert isinstance(eng.runner, cuda_runner.KernelRunner)
    assert all(isinstance(b, cuda_runner.FusedBlock) for b in eng.runner.blocks)
    got = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts])
    assert got == want


def test_a_second_engine_on_the_same_model_reuses_its_fused_blocks(tiny_model_dir, expected, monkeypatch):
    """Benches build several engines on one loaded model (with and without speculation):
    the second finds the layers fused and must neither fail nor fuse them again."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts, want = expected
    model = _fresh(tiny_model_dir)
    first = _engine(model)
    blocks = list(first.runner.blocks)
    second = _engine(model)
    assert isinstance(second.runner, cuda_runner.KernelRunner)
    assert all(a is b for a, b in zip(blocks, second.runner.blocks))
    assert second.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts]) == want


@pytest.mark.parametrize("every", [1, 0])
def test_fresh_prefill_with_layer_0_in_two_hand_overs_keeps_the_tokens(tiny_model_dir, expected, monkeypatch,
                                                                      every):
    """``PREFILL_FIRST_SPLIT``: layer 0's attention handed over before its MLP (and
    not where the prefill is handed over once, at the end): the same tokens."""
    import mlx.core as mx

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    monkeypatch.setattr(cuda_runner, "PREFILL_FIRST_SPLIT", True)
    monkeypatch.setattr(cuda_runner, "PREFILL_EVAL_EVERY", every)
    prompts, want = expected
    eng = _engine(_fresh(tiny_model_dir), max_batch_prefill=3)
    halves = []  # every attention half's output, in order
    real = eng.runner._prefill_attention

    def attention(*a):
        out = real(*a)
        halves.append(out[0])
        return out
    eng.runner._prefill_attention = attention
    handed = []
    real_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: handed.extend(a) or real_eval(*a))
    assert eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts]) == want
    # The last layer runs its own half (PREFILL_LAST_ROWS, on by default).
    per = len(eng.runner.blocks) - 1
    firsts = halves[::per]  # layer 0's of each fresh prefill
    assert len(firsts) >= 3 and len(halves) == len(firsts) * per
    was_handed = [any(x is a for a in handed) for x in halves]
    # Layer 0's first half is handed over on its own where the layers are; no other half is.
    assert was_handed == [bool(every) and i % per == 0 for i in range(len(halves))]


def test_fresh_prefill_last_layer_on_last_rows_keeps_the_logits(tiny_model_dir, expected, monkeypatch):
    """``PREFILL_LAST_ROWS``: the last layer's o product and MLP at each row's last position
    only. Its output is one row per prompt, and the fresh prefills' logits (ragged batches
    included) equal those of the layer run at every position."""
    import mlx.core as mx
    import numpy as np

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts, want = expected
    logits, last_rows = {}, []
    for on in (False, True):
        monkeypatch.setattr(cuda_runner, "PREFILL_LAST_ROWS", on)
        eng = _engine(_fresh(tiny_model_dir), max_batch_prefill=3)
        got = logits[on] = []
        real_fresh = eng.runner._fresh_prefill

        def fresh(rows, inputs, real_fresh=real_fresh, got=got):
            out = real_fresh(rows, inputs)
            got.append(np.array(out.astype(mx.float32)))
            return out
        eng.runner._fresh_prefill = fresh
        real_last = eng.runner._prefill_last_layer

        def last_layer(blk, h, *a, real_last=real_last):
            out = real_last(blk, h, *a)
            last_rows.append((h.shape, out[0].shape))
            return out
        eng.runner._prefill_last_layer = last_layer
        assert eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts]) == want
    assert last_rows and all(out == (B, W) for (B, _, W), out in last_rows)
    assert len(last_rows) == len(logits[True]) == len(logits[False])
    assert any(h[0] > 1 for h, _ in last_rows)  # a ragged batch took the path too
    for a, b in zip(logits[False], logits[True]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_reference_decode_logits_match_the_portable_runner(tiny_model_dir):
    """One decode step of a ragged batch: kernel-path logits == PagedRunner logits."""
    import mlx.core as mx
    import numpy as np

    from tandem.pipeline.kv_store import KVStore
    from tandem.pipeline.runner import probe

    lens = [5, 21, 16, 1]
    models = [_fresh(tiny_model_dir), _fresh(tiny_model_dir)]
    outs = []
    for i, model in enumerate(models):
        sh = probe(model)
        store = KVStore(sh.num_layers, sh.n_kv_heads, sh.head_dim, sh.dtype, 4, 64)
        runner = (cuda_runner.KernelRunner(model, store, ops="reference") if i else
                  PagedRunner(model, store, mirror=False))
        rows = _rows(lens, 4)
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, 300, (len(lens), max(lens))).astype(np.int32)
        for r, n in zip(rows, lens):
            r.n = n
        runner.forward(rows, mx.array(prompts))  # prefill: the portable path in both
        for r, n in zip(rows, lens):
            r.start, r.n = n, 1
        out = runner.forward(rows, mx.array(rng.integers(3, 300, (len(lens), 1)).astype(np.int32)))
        mx.eval(out)
        outs.append(out)
    assert outs[0].shape == outs[1].shape
    assert mx.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4).item()


def _rows(lens, bs):
    from types import SimpleNamespace

    rows, next_block = [], 0
    for n in lens:
        nb = -(-(n + 1) // bs)
        seq = SimpleNamespace(block_ids=list(range(next_block, next_block + nb)), serial=len(rows), num_preemptions=0)
        next_block += nb
        rows.append(SimpleNamespace(seq=seq, start=0, n=n, logits=1))  # as a Row without a draft
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
@pytest.mark.parametrize("quantized,compiled,fused", [(False, False, 0), (True, False, 0), (False, True, 0),
                                                     (True, True, 0), (False, True, 16), (False, False, 16)])
def test_cuda_kernel_runner_matches_alone(tiny_model_dir, tiny_quantized_model_dir, monkeypatch, quantized, compiled,
                                          fused):
    """fused: decode steps below that many rows run the one-launch RoPE + write + attention."""
    from tandem.kernels.cuda import decode_attention_cuda as dac

    from tandem.kernels.cuda import w4gemm

    monkeypatch.setattr(dac, "MAX_ROWS", fused)
    # The tiny model's products are small; let its 9-row decode steps run w4gemm anyway.
    monkeypatch.setattr(w4gemm, "MIN_WEIGHTS", 0)
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    monkeypatch.setattr(cuda_runner, "DECODE_COMPILE", compiled)
    path = tiny_quantized_model_dir if quantized else tiny_model_dir
    ref = _fresh(path)
    prompts = random_prompts(9, 1, 70, seed=11)
    want = [oracle(ref, p, MAX_TOKENS) for p in prompts]
    eng = _engine(_fresh(path))
    assert isinstance(eng.runner, cuda_runner.KernelRunner) and eng.runner.compiled == compiled
    got = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts], timeout=180)
    if not quantized:
        assert got == want
        return
    # Quantized: decode reads the 4-bit weights, the oracle's prefill too, the runner's
    # prefill the dense copy; a near-tie may flip a late token, so compare the agreeing
    # prefix of each sequence.
    agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
             for g, w in zip(got, want)]
    assert sum(agree) >= 0.75 * sum(len(w) for w in want), (got, want)


@pytest.fixture(scope="module")
def wide_quantized_model_dir(tmp_path_factory):
    """4-bit, fp16, hidden 1024 and FFN 2048: shapes every one-row kernel covers."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide-q4"), quantize=True, dtype="float16", head_dim=128,
                            hidden=1024, ffn=2048, heads=8, kv_heads=2)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
def test_one_row_decode_gives_mlx_lm_tokens(wide_quantized_model_dir, monkeypatch):
    """One-row decode steps through the one-row products: mlx_lm's tokens, up to a late near-tie."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    ref = _fresh(wide_quantized_model_dir)
    prompts = random_prompts(4, 1, 70, seed=13)
    want = [oracle(ref, p, MAX_TOKENS) for p in prompts]
    eng = _engine(_fresh(wide_quantized_model_dir), max_batch_size=1)
    got = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts], timeout=180)
    agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
             for g, w in zip(got, want)]
    assert sum(agree) >= 0.75 * sum(len(w) for w in want), (got, want)


@pytest.fixture(scope="module")
def graph_model_dir(tmp_path_factory):
    """The wide 4-bit model with a head of its own and a vocabulary padded to whole 256-row
    blocks: every op of its one-row step is a tandem kernel (the tied head would be MLX's
    own matmul), and every layer, the head included, one ``w4wgmma`` covers once packed."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("graph-q4"), quantize=True, dtype="float16", head_dim=128,
                            hidden=1024, ffn=2048, heads=8, kv_heads=2, tie=False, vocab_multiple=256)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(300, method="thread")
def test_captured_one_row_steps_give_the_tokens_of_mlx_launches(graph_model_dir, monkeypatch):
    """One greedy row at a time, 40 tokens each (several table widths): the CUDA graph
    replays (pipeline/runners/cuda/graph_step.py) give exactly the tokens of MLX's own launches of the
    same kernels, and mlx_lm's up to a late near-tie; sampled rows still run through MLX."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    prompts = random_prompts(3, 1, 70, seed=17)
    n = 40
    ref = _fresh(graph_model_dir)
    want = [oracle(ref, p, n) for p in prompts]
    runs = {}
    for on in (True, False):
        eng = _engine(_fresh(graph_model_dir), max_batch_size=1, decode_graphs=on)
        assert (eng.runner.graph_step is not None) == on
        runs[on] = [eng.generate_many([(p, greedy(n))], timeout=240)[0] for p in prompts]
        if on:
            g = eng.runner.graph_step
            assert g.failed is None and g.replays >= len(prompts) * (n - 2), (g.failed, g.replays)
            # Captured at start, every table width the store can hold up to 4096 tokens.
            bs = eng.store.block_size
            assert len(g._graphs) >= 2 and max(k[1] for k in g._graphs) * bs >= min(4096, eng.store.num_blocks * bs)
            sampled = eng.generate_many([(prompts[0], SamplingParams(temperature=0.7, max_tokens=8, seed=3))])
            assert len(sampled[0]) == 8 and g.replays >= len(prompts) * (n - 2)
    assert runs[True] == runs[False]
    agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
             for g, w in zip(runs[True], want)]
    assert sum(agree) >= 0.75 * sum(len(w) for w in want), (runs[True], want)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(300, method="thread")
def test_captured_steps_of_several_rows_give_the_tokens_of_mlx_launches(graph_model_dir, monkeypatch):
    """Greedy rows together, of several lengths (rows leave the batch as they finish, so the
    row class changes): the captured steps give exactly the tokens of MLX's launches of the
    same kernels, and steps of several rows were captured and replayed."""
    from tandem.pipeline.runners.cuda import graph_step

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    prompts = random_prompts(6, 5, 60, seed=23)
    lengths = [40, 33, 21, 40, 12, 27]
    runs = {}
    for on in (True, False):
        eng = _engine(_fresh(graph_model_dir), decode_graphs=on)
        if on:
            eng.runner.warm_decode(8)  # the worker's warm-up: row classes up to 8
            g = eng.runner.graph_step
            # Some row classes above one captured (a class whose products are MLX's own is
            # refused, with the wider ones; tokens stay right either way).
            assert any(k[0] > 1 for k in g._graphs), (g.rows_limit, g.rows_failed, list(g._graphs))
        runs[on] = eng.generate_many([(p, greedy(m)) for p, m in zip(prompts, lengths)], timeout=240)
        if on:
            assert g.failed is None and g.replays >= 20, (g.failed, g.rows_failed, g.replays)
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(400, method="thread")
def test_captured_steps_of_17_rows_and_more_give_the_tokens_of_mlx_launches(graph_model_dir, monkeypatch):
    """Every layer packed (the 8B's are; this model's are below ``MIN_WEIGHTS``): steps of 17
    to 32 rows are tandem's kernels only (``linear.capture_rows``: wgmma with K splits, the
    split sums cast by ``to_half``), so they are captured, and their replays give exactly the
    tokens of MLX's launches of the same kernels."""
    from tandem.kernels.cuda import linear
    from tandem.kernels.cuda import w4gemm
    from tandem.pipeline.runners.cuda import graph_step

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    monkeypatch.setattr(w4gemm, "MIN_WEIGHTS", 0)
    prompts = random_prompts(30, 5, 40, seed=29)
    lengths = [24 + (i * 7) % 17 for i in range(len(prompts))]
    runs = {}
    for on in (True, False):
        model = _fresh(graph_model_dir)
        eng = _engine(model, decode_graphs=on, max_batch_size=32, kv_cache_budget="64MiB")
        if on:
            eng.runner.warm_decode(32)
            g = eng.runner.graph_step
            wide = sorted({k[0] for k in g._graphs if k[0] > 16})
            assert wide == [24, 32], (g.rows_limit, g.rows_failed, sorted({k[0] for k in g._graphs}))
        else:  # MLX's launches of the kernels the captured steps hold
            assert linear.capture_rows(model, graph_step.MAX_ROWS) > 0
        runs[on] = eng.generate_many([(p, greedy(m)) for p, m in zip(prompts, lengths)], timeout=300)
        if on:
            assert g.failed is None and g.replays >= 20, (g.failed, g.rows_failed, g.replays)
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(300, method="thread")
def test_captured_verifying_steps_give_the_tokens_of_mlx_launches(graph_model_dir, monkeypatch):
    """Drafts right and wrong (MixedDrafter), verified through captured steps and through
    MLX's launches of the same kernels: the same tokens, and verifying steps were captured."""
    from tandem.pipeline.speculation import Speculator, StepTimes
    from tests.pipeline.test_speculation import MixedDrafter

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    prompts = random_prompts(4, 5, 40, seed=37)
    runs = {}
    for on in (True, False):
        model = _fresh(graph_model_dir)
        eng = Engine(model, EngineSettings(kv_cache_budget="16MiB", decode_graphs=on), model_id="tiny",
                     eos_token_ids=[EOS],
                     speculator=Speculator(MixedDrafter(_fresh(graph_model_dir), seed=5), times=StepTimes(0.0, measured=False)))
        if on:
            eng.runner.warm_decode(4, verify_rows=4 * 5)
            g = eng.runner.graph_step
            assert any(k[2] for k in g._graphs), (g.verify_limit, g.verify_failed, list(g._graphs))
        runs[on] = eng.generate_many([(p, greedy(24)) for p in prompts], timeout=240)
        assert eng.speculator.counters.verify_steps > 0
    assert runs[True] == runs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
def test_select_ids_kernel_equals_the_reference():
    from tandem.pipeline.runners.cuda import graph_step

    prev = mx.array([11, 22, 33, 44, 55], dtype=mx.int32)
    # P = 6: rows 0, 2, 4 take the previous step's rows 4, 0, 2; rows 1, 3, 5 host tokens
    sel = mx.array([4, -1, 0, -1, 2, -1] + [0, 9, 0, 13, 0, 14], dtype=mx.int32)
    got = graph_step.select_ids(prev, sel)
    assert got.shape == (6, 1)
    assert got.reshape(-1).tolist() == [55, 9, 11, 13, 33, 14]
    assert mx.array_equal(got, graph_step.select_ids_reference(prev, sel))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
def test_a_step_with_mlx_ops_between_kernels_is_not_captured(tiny_model_dir, monkeypatch):
    """fp16 weights: the step runs MLX's own matmuls between the kernels, which a replay
    would not redo; the capture's check refuses it and MLX's launches give the tokens."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    ref = _fresh(tiny_model_dir)
    prompts = random_prompts(2, 1, 40, seed=19)
    want = [oracle(ref, p, MAX_TOKENS) for p in prompts]
    eng = _engine(_fresh(tiny_model_dir), max_batch_size=1)
    got = [eng.generate_many([(p, greedy(MAX_TOKENS))], timeout=180)[0] for p in prompts]
    assert got == want
    assert eng.runner.graph_step is not None and eng.runner.graph_step.failed is not None


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
def test_compiled_prefill_layers_give_mlx_lm_tokens(tiny_model_dir, monkeypatch):
    """Prefills of 64 and 128 tokens (one alone, then two padded to 128) replay compiled
    layers; a 70-token one does not. All give mlx_lm's tokens."""
    import random

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (64, 128, 100, 70)]
    ref = _fresh(tiny_model_dir)
    want = [oracle(ref, p, MAX_TOKENS) for p in prompts]
    eng = _engine(_fresh(tiny_model_dir), max_batch_prefill=2)
    assert eng.runner._prefill_fns is not None
    calls = []
    # The last layer is the one compiled function every fresh prefill calls once, whatever
    # the split of layer 0 (PREFILL_LAST_ROWS, the default).
    real = eng.runner._prefill_last

    def spy(*a):
        calls.append(a[0].shape)
        return real(*a)
    eng.runner._prefill_last = spy
    assert eng.generate_many([(prompts[0], greedy(MAX_TOKENS))]) == want[:1]
    assert eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts[1:3]]) == want[1:3]
    assert eng.generate_many([(prompts[3], greedy(MAX_TOKENS))]) == want[3:]
    assert [c[:2] for c in calls] == [(1, 64), (2, 128)]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
def test_compiled_prefill_with_layer_0_split_gives_mlx_lm_tokens(tiny_model_dir, monkeypatch):
    """The compiled halves of layer 0 (``PREFILL_FIRST_SPLIT``) at 64 and 128 tokens."""
    import random

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    monkeypatch.setattr(cuda_runner, "PREFILL_FIRST_SPLIT", True)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (64, 128, 128)]
    ref = _fresh(tiny_model_dir)
    want = [oracle(ref, p, MAX_TOKENS) for p in prompts]
    eng = _engine(_fresh(tiny_model_dir), max_batch_prefill=2)
    assert eng.runner._prefill_first is not None
    assert eng.generate_many([(prompts[0], greedy(MAX_TOKENS))]) == want[:1]
    assert eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts[1:]]) == want[1:]


@pytest.fixture(scope="module")
def tiny_fp16_hd64_dir(tmp_path_factory):
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-fp16-hd64"), head_dim=64, dtype="float16")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")
@pytest.mark.timeout(300, method="thread")
def test_tile_write_runner_equals_write_then_attend(tiny_fp16_hd64_dir, monkeypatch):
    """Decode steps of 2-9 rows through the tile-wise attention with the write inside
    (the tile threshold lowered from 16 rows to 2 for the tiny batch) give the tokens of
    the same steps through the write kernel and then the attention kernel. Compared with
    that path, not with mlx_lm: the kernels are bit-equal, while mlx_lm's fp16 matmuls
    round differently and the random model has near-ties (top-2 margins of 0.02 in the
    fp32 model)."""
    from tandem.kernels.cuda import decode_attention_cuda as dac
    from tandem.kernels.cuda import paged_attention_cuda as pac

    monkeypatch.setattr(dac, "MAX_ROWS", 0)
    monkeypatch.setattr(pac, "TILE_MIN_BATCH", 2)
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    prompts = random_prompts(9, 1, 70, seed=13)
    requests = [(p, greedy(MAX_TOKENS)) for p in prompts]
    supported = dac.tile_supported
    monkeypatch.setattr(dac, "tile_supported", lambda *a: False)  # the write kernel, then the attention
    want = _engine(_fresh(tiny_fp16_hd64_dir)).generate_many(requests, timeout=180)
    calls = []
    tile = dac.decode_attention_tile

    def spy(*a, **kw):  # called when a step is traced (the compiled step replays without it)
        calls.append(a[0].shape[0])
        return tile(*a, **kw)

    monkeypatch.setattr(dac, "tile_supported", supported)
    monkeypatch.setattr(dac, "decode_attention_tile", spy)
    got = _engine(_fresh(tiny_fp16_hd64_dir)).generate_many(requests, timeout=180)
    assert calls and min(calls) >= 2
    assert got == want
    assert len({tuple(t) for t in want}) > 1  # the model does not collapse to one answer


def test_pipelined_steps_yield_the_same_tokens(tiny_model_dir, expected, monkeypatch):
    """Decode steps queued before the previous step is read back (what the in-place CUDA
    path does) finish, stop and free exactly as read-back-first steps do. The reference
    ops' writes are functional, so here that order only costs copies, never tokens."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts, want = expected
    eng = _engine(_fresh(tiny_model_dir), block_size=4, parallel=5)
    assert not eng.runner.pipelined
    eng.runner.pipelined = True
    early = []
    forward = eng.runner.forward

    def spy(rows, inputs):
        out = forward(rows, inputs)
        early.append(eng.runner.last_step_in_place)
        return out

    eng.runner.forward = spy
    assert eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts]) == want
    assert any(early) and not all(early)  # decode steps went early, prefills did not
    eng.pool.check()


def test_table_width_buckets_are_few_and_cover():
    widths = [cuda_runner.table_width(nb) for nb in range(1, 4097)]
    assert all(w >= nb for nb, w in zip(range(1, 4097), widths))
    assert widths == sorted(widths)
    assert all(w <= max(4, 1.5 * nb) for nb, w in zip(range(1, 4097), widths))  # <= 50% padding
    assert len(set(widths)) <= 2 * 12  # two per doubling, not one trace per block


def test_decode_steps_reuse_few_table_shapes(tiny_model_dir, tiny, monkeypatch):
    """A long decode crosses many block boundaries; the step sees the bucketed table
    widths only (each new shape is a ~10 ms retrace of the compiled step on a GPU), and
    the padded tables give the same tokens as mlx_lm alone."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts = random_prompts(3, 5, 9, seed=5)
    want = [oracle(tiny, p, 40) for p in prompts]
    eng = _engine(_fresh(tiny_model_dir), block_size=4)
    seen = []
    step_fn = eng.runner._step_fn

    def recording(inputs, pos, slots, table, *rest):
        seen.append(table.shape[1])
        return step_fn(inputs, pos, slots, table, *rest)

    monkeypatch.setattr(eng.runner, "_step_fn", recording)
    got = eng.generate_many([(p, greedy(40)) for p in prompts])
    assert got == want
    # ~12 blocks of 4 tokens are crossed; the widths seen are buckets 4, 6, 8, 12, 16
    assert max(len(p) + 40 for p in prompts) // 4 >= 11
    assert len(seen) >= 39 and set(seen) <= {4, 6, 8, 12, 16}


def test_step_state_is_uploaded_only_when_rows_leave_their_blocks(tiny_model_dir, tiny, monkeypatch):
    """A one-row decode re-uses the last step's device array of positions, slots and table
    plus an increment while the row stays in its block, and uploads a new one when it
    enters a block: every step's device state equals what the host computed, and the
    tokens are mlx_lm's."""
    import mlx.core as mx
    import numpy as np

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompt = random_prompts(1, 9, 9, seed=8)[0]
    eng = _engine(_fresh(tiny_model_dir), block_size=4, max_batch_size=1)
    runner = eng.runner
    states = []
    step_state = runner._step_state

    def recording(host, *a):
        dev = step_state(host, *a)
        states.append((host.copy(), dev))
        return dev

    monkeypatch.setattr(runner, "_step_state", recording)
    got = eng.generate_many([(prompt, greedy(40))])
    assert got == [oracle(tiny, prompt, 40)]
    assert len(states) >= 39
    assert all(np.array_equal(np.array(dev), host) for host, dev in states)
    # 40 tokens cross 10 blocks of 4 (and 2 table widths): an upload at each, not each step
    assert 10 <= runner.state_uploads <= 14


def test_fresh_slots_match_the_block_table_formula_for_padded_rows():
    """Each position's slot is (its block's id + 1) * block_size + position % block_size
    (the store's block 0 is scratch), -1 past the row's n; row ends count in (B, L) order."""
    import types

    import numpy as np

    from tandem.pipeline.sequence import Row

    bs, L = 4, 11
    runner = types.SimpleNamespace(store=types.SimpleNamespace(block_size=bs), _slot_offsets={})
    seqs = [types.SimpleNamespace(block_ids=ids) for ids in ([7, 2, 9], [5], [3, 8, 1, 6])]
    rows = [Row(seqs[0], 0, 11, True), Row(seqs[1], 0, 3, True), Row(seqs[2], 0, 9, False)]
    for _ in range(2):  # the second call reads the cached offsets
        slots, last = cuda_runner.KernelRunner._fresh_slots(runner, rows, L)
        want = np.full((3, L), -1, np.int64)
        for i, r in enumerate(rows):
            for p in range(r.n):
                want[i, p] = (r.seq.block_ids[p // bs] + 1) * bs + p % bs
        assert slots.dtype == np.int32 and last.dtype == np.int32
        assert slots.tolist() == want.reshape(-1).tolist()
        assert last.tolist() == [10, L + 2, 2 * L + 8]


def test_decode_steps_run_padded_row_classes_that_the_warm_up_traces(tiny_model_dir, tiny, monkeypatch):
    """A decode step of B sequences runs tables.decode_rows(B) rows (the padding writes
    nowhere and its logits are dropped: five sequences decode mlx-lm's tokens in steps of 6
    rows, and the device state still advances by increment between uploads); the warm-up runs
    every row class and width up to its bounds."""
    import mlx.core as mx
    import numpy as np

    from tandem.pipeline.runners.cuda.tables import decode_rows

    assert [decode_rows(b) for b in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 33, 65, 100)] == [
        1, 2, 3, 4, 6, 6, 8, 12, 16, 24, 48, 96, 128]
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts = random_prompts(5, 9, 9, seed=3)
    eng = _engine(_fresh(tiny_model_dir), block_size=4, max_batch_prefill=5)
    runner = eng.runner
    rows, states = [], []
    step_fn, step_state = runner._step_fn, runner._step_state
    runner._step_fn = lambda inputs, *a: rows.append(inputs.shape[0]) or step_fn(inputs, *a)

    def recording(host, *a):
        dev = step_state(host, *a)
        states.append((host.copy(), dev))
        return dev

    runner._step_state = recording
    got = eng.generate_many([(p, greedy(20)) for p in prompts])
    assert got == [oracle(tiny, p, 20) for p in prompts]
    assert 6 in rows and 5 not in rows and all(r == decode_rows(r) for r in rows)
    assert all(np.array_equal(np.array(dev), host) for host, dev in states)
    assert runner.state_uploads < len(states)  # padded rows do not defeat the increment
    rows.clear()
    assert runner.warm_decode(5, max_tokens=24) == 5 * 2  # rows 1, 2, 3, 4, 6 x widths 4, 6
    assert sorted(set(rows)) == [1, 2, 3, 4, 6]
    verified = []
    verify_fn = runner._verify_fn
    runner._verify_fn = lambda inputs, *a: verified.append(inputs.shape[0]) or verify_fn(inputs, *a)
    rows.clear()
    # A drafting worker: its verifying steps too, rows 2 .. 3 x (1 + 4) -> 2, 3, 4, 6, 8, 12, 16.
    assert runner.warm_decode(3, max_tokens=24, verify_rows=15) == (3 + 7) * 2
    assert sorted(set(rows)) == [1, 2, 3] and sorted(set(verified)) == [2, 3, 4, 6, 8, 12, 16]
    mx.eval(runner.store.keys)


class _Recorded:
    """Proposes each prompt's greedy continuation recorded without speculation; a draft of
    three or more has its last token wrong at every other position (drafts accepted whole
    and in part)."""

    cost = 0.0

    def __init__(self, recorded: dict[tuple, list[int]]):
        self.recorded = recorded

    def propose(self, seq, k: int) -> list[int]:
        done = len(seq.tokens) - seq.prompt_len
        out = list(self.recorded[tuple(seq.tokens[: seq.prompt_len])][done : done + k])
        if len(out) >= 3 and done % 2:
            out[-1] = (out[-1] + 1) % 50
        return out

    def drop(self, serial: int) -> None:
        pass


@pytest.mark.parametrize("config", [dict(), dict(block_size=4, max_batch_size=3, parallel=6)])
def test_drafts_verify_through_the_decode_step_with_the_tokens_of_no_speculation(tiny_model_dir, monkeypatch,
                                                                                 config):
    """A verifying step runs each drafted position as a one-token row of the decode step
    (its sequence's table, its own position), every K/V written before any row attends:
    at temperature 0 the tokens are those of the engine without speculation, drafts were
    accepted and rejected, and the portable prefill path verified none of them."""
    from tandem.pipeline.speculation import Speculator, StepTimes

    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts = random_prompts(6, 10, 40, seed=5)
    n = 24
    plain = _engine(_fresh(tiny_model_dir), **config).generate_many([(p, greedy(n)) for p in prompts])
    spec = Speculator(_Recorded({tuple(p): t for p, t in zip(prompts, plain)}), max_draft=4, retry_steps=2,
                      times=StepTimes(0.1, measured=False))
    eng = Engine(_fresh(tiny_model_dir), EngineSettings(kv_cache_budget="16MiB", **config), model_id="tiny",
                 eos_token_ids=[EOS], speculator=spec)
    portable = []
    real = PagedRunner.forward
    monkeypatch.setattr(PagedRunner, "forward", lambda self, rows, inputs: (
        portable.append(any(r.draft for r in rows)), real(self, rows, inputs))[1])
    got = eng.generate_many([(p, greedy(n)) for p in prompts])
    assert got == plain
    c = spec.counters
    assert eng.runner.verify_steps > 0 and 0 < c.accepted < c.drafted
    assert not any(portable)  # no drafted row went through the portable path
    st = eng.stats()
    assert st.running == 0 and st.free_blocks == st.total_blocks
    eng.pool.check()
