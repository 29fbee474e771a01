"""input_box on the CPU: the ring and its serials with a stand-in for the GPU's copy kernel
(it reads the host memory where the kernel would), and the engine's fresh prefills taking
their inputs from it (the reference kernel runner): mlx-lm's tokens, whether the box is
free or still being read."""

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from tandem.pipeline.runners.cuda import runner as cuda_runner
from tandem.pipeline.runners.cuda import input_box
from tests.pipeline.conftest import host_alloc, random_prompts, two_row_engine
from tests.pipeline.test_engine import greedy


def _fake_kernel(done=True, reads=None):
    """Does at once what the GPU kernel does: the box's words into the output, positions
    made, and (``done``) the post's serial copied into the header."""
    def kernel(*, inputs, output_shapes, **kw):
        ptr = int(np.array(inputs[0])[0])
        hdr = (ctypes.c_int32 * input_box.HEADER).from_address(ptr)
        n, L, rows, serial = hdr[0], hdr[1], hdr[2], hdr[3]
        words = np.ctypeslib.as_array((ctypes.c_int32 * (2 * n + rows)).from_address(ptr + 4 * input_box.HEADER))
        out = np.concatenate([words[:n], np.arange(n, dtype=np.int32) % L, words[n:]])
        assert out.shape == output_shapes[0]
        if reads is not None:
            reads.append(ptr)
        if done:
            hdr[4] = serial
        return [mx.array(out)]
    return kernel


def test_a_post_gives_the_host_arrays_and_the_ring_turns():
    reads = []
    box = input_box.InputBox(host_alloc, kernel=_fake_kernel(reads=reads))
    for i in range(input_box.RING + 2):
        ids = np.arange(6, dtype=np.int32).reshape(2, 3) + 10 * i
        slots = np.array([4, 5, -1, 8, 9, 10], np.int32) + i
        last = np.array([1, 5], np.int32)
        got = box.post(ids, slots, last)
        assert np.array_equal(np.array(got.ids), ids)
        assert np.array_equal(np.array(got.pos), [0, 1, 2, 0, 1, 2])
        assert np.array_equal(np.array(got.slots), slots)
        assert np.array_equal(np.array(got.last), last)
    assert len(set(reads)) == input_box.RING and reads[0] == reads[input_box.RING]
    assert box.posted == input_box.RING + 2 and box.busy == 0


def test_a_box_not_yet_read_is_not_written():
    box = input_box.InputBox(host_alloc, kernel=_fake_kernel(done=False))
    ids, slots, last = np.ones((1, 4), np.int32), np.arange(4, dtype=np.int32), np.array([3], np.int32)
    for _ in range(input_box.RING):
        assert box.post(ids, slots, last) is not None
    first = box.boxes[0]
    before = first.words[:4].copy()
    assert box.post(ids * 7, slots, last) is None  # the first box's copy has not said it is done
    assert np.array_equal(first.words[:4], before) and box.busy == 1
    first.header[4] = first.header[3]  # now it has
    got = box.post(ids * 7, slots, last)
    assert got is not None and np.array_equal(np.array(got.ids), ids * 7)


def test_only_chunks_within_the_box_apply():
    assert input_box.InputBox.applies(2, 2048)
    assert input_box.InputBox.applies(input_box.MAX_ROWS, input_box.MAX_TOKENS // input_box.MAX_ROWS)
    assert not input_box.InputBox.applies(1, input_box.MAX_TOKENS + 1)
    assert not input_box.InputBox.applies(input_box.MAX_ROWS + 1, 1)
    assert not input_box.InputBox.applies(0, 8)
    box = input_box.InputBox(host_alloc, kernel=_fake_kernel())
    big = np.zeros((1, input_box.MAX_TOKENS + 1), np.int32)
    assert box.post(big, np.zeros(big.size, np.int32), np.zeros(1, np.int32)) is None and box.busy == 1


def test_the_check_catches_a_kernel_that_copies_wrong():
    def off_by_one(**kw):
        (out,) = _fake_kernel()(**kw)
        return [out + 1]
    assert input_box.check(input_box.InputBox(host_alloc, kernel=_fake_kernel()))
    assert not input_box.check(input_box.InputBox(host_alloc, kernel=off_by_one))


def test_none_without_cuda():
    if __import__("tandem.kernels.cuda.quantized_matmul", fromlist=["x"]).cuda_available():
        pytest.skip("MLX's CUDA backend is here")
    assert input_box.make() is None


@pytest.mark.parametrize("done", [True, False])
def test_engine_takes_fresh_prefill_inputs_from_the_box(tiny_model_dir, monkeypatch, done):
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts = random_prompts(12, 1, 60, seed=5)
    eng, want = two_row_engine(tiny_model_dir, prompts, 6)
    assert isinstance(eng.runner, cuda_runner.KernelRunner)
    box = input_box.InputBox(host_alloc, kernel=_fake_kernel(done=done))
    eng.runner._input_box = box
    assert eng.runner.takes_host_ids
    assert eng.generate_many([(p, greedy(6)) for p in prompts]) == want
    if done:
        assert box.posted > input_box.RING and box.busy == 0  # every fresh prefill (a batch of two counts once)
    else:
        assert box.posted == input_box.RING and box.busy >= 1  # then the runner's own arrays


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("tandem.kernels.cuda.quantized_matmul", fromlist=["x"]).cuda_available(),
                    reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
def test_gpu_input_box_gives_mlx_lm_tokens(tiny_model_dir, monkeypatch):
    """The real kernel and pinned boxes: every fresh prefill's inputs come through the box,
    and the tokens are mlx-lm's."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    prompts = random_prompts(6, 1, 70, seed=9) + [list(range(3, 67))]
    eng, want = two_row_engine(tiny_model_dir, prompts, 8)
    box = eng.runner._input_box
    assert box is not None
    assert eng.generate_many([(p, greedy(8)) for p in prompts]) == want
    assert box.posted >= 4
