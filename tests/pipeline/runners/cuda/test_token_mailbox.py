"""token_mailbox on the CPU: the box logic with a stand-in for the GPU's kernel (host memory
written where the kernel would write it), and the engine reading a prefill's tokens from it
(the reference kernel runner): the same tokens as mlx-lm, and MLX's read where the box fails."""

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from tandem.pipeline.runners.cuda import runner as cuda_runner
from tandem.pipeline.runners.cuda import token_mailbox
from tests.pipeline.conftest import host_alloc, random_prompts, two_row_engine
from tests.pipeline.test_engine import greedy


def _fake_kernel(count_offset=0, fill=True):
    """Does at once what the GPU kernel does: tokens into the box, then the count and flag."""
    def kernel(*, inputs, **kw):
        tokens, addr = inputs
        ptr = int(np.array(addr)[0])
        if fill:
            vals = np.array(tokens, np.int32)
            words = (ctypes.c_int32 * (2 + len(vals))).from_address(ptr)
            words[2:] = vals.tolist()
            words[1] = len(vals) + count_offset
            words[0] = 1
        return [mx.array([len(np.array(tokens))], mx.int32)]
    return kernel


def test_a_posted_box_gives_its_tokens_and_the_ring_turns():
    box = token_mailbox.TokenMailbox(host_alloc, kernel=_fake_kernel())
    seen = set()
    for i in range(token_mailbox.RING + 1):
        want = [i, 100 + i, 7]
        ticket, done = box.post(mx.array(want, mx.int32), None)
        seen.add(ticket.box.ptr)
        assert ticket.wait(spin_s=0.01) == want
    assert len(seen) == token_mailbox.RING and box.posted == token_mailbox.RING + 1


def test_a_box_never_filled_or_miscounted_gives_up():
    empty = token_mailbox.TokenMailbox(host_alloc, kernel=_fake_kernel(fill=False))
    ticket, _ = empty.post(mx.array([1, 2], mx.int32), None)
    assert ticket.wait(spin_s=0.002) is None
    wrong = token_mailbox.TokenMailbox(host_alloc, kernel=_fake_kernel(count_offset=1))
    ticket, _ = wrong.post(mx.array([1, 2], mx.int32), None)
    assert ticket.wait(spin_s=0.002) is None


def test_a_box_is_reset_before_its_next_post():
    box = token_mailbox.TokenMailbox(host_alloc, kernel=_fake_kernel())
    first, _ = box.post(mx.array([5], mx.int32), None)
    assert first.wait(spin_s=0.01) == [5]
    box._kernel = _fake_kernel(fill=False)
    for _ in range(token_mailbox.RING - 1):
        box.post(mx.array([6], mx.int32), None)
    again, _ = box.post(mx.array([6], mx.int32), None)  # the first box again: its old flag is gone
    assert again.box is first.box and again.wait(spin_s=0.002) is None


def test_only_int32_rows_within_the_box_apply():
    box = token_mailbox.TokenMailbox(host_alloc, kernel=_fake_kernel())
    assert box.applies(mx.zeros((3,), mx.int32))
    assert not box.applies(mx.zeros((3,), mx.uint32))
    assert not box.applies(mx.zeros((token_mailbox.MAX_ROWS + 1,), mx.int32))
    assert not box.applies(mx.zeros((2, 2), mx.int32))


def test_none_without_cuda():
    assert token_mailbox.make() is None


@pytest.mark.parametrize("works", [True, False])
def test_engine_reads_a_fresh_prefills_tokens_from_the_box(tiny_model_dir, monkeypatch, works):
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "reference")
    prompts = random_prompts(5, 1, 60, seed=3)
    eng, want = two_row_engine(tiny_model_dir, prompts, 6)
    assert isinstance(eng.runner, cuda_runner.KernelRunner)
    box = token_mailbox.TokenMailbox(host_alloc, kernel=_fake_kernel(count_offset=0 if works else 1))
    monkeypatch.setattr(token_mailbox, "SPIN_S", 0.002)
    eng.runner.mailbox = box
    assert eng.generate_many([(p, greedy(6)) for p in prompts]) == want
    assert box.posted >= 3  # every fresh prefill (a batch of two counts once)
    if works:
        assert box.spun == box.posted and box.fell_back == 0
    else:
        assert box.fell_back == box.posted and box.spun == 0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("tandem.kernels.cuda.quantized_matmul", fromlist=["x"]).cuda_available(),
                    reason="needs MLX's CUDA backend")
@pytest.mark.timeout(240, method="thread")
def test_gpu_box_gives_mlx_lm_tokens(tiny_model_dir, monkeypatch):
    """The real kernel and pinned boxes: every fresh prefill's tokens come back through the
    box, and they are mlx-lm's."""
    monkeypatch.setenv("TANDEM_PAGED_KERNELS", "cuda")
    prompts = random_prompts(4, 1, 70, seed=8) + [list(range(3, 67))]
    eng, want = two_row_engine(tiny_model_dir, prompts, 8)
    assert eng.runner.mailbox is not None
    assert eng.generate_many([(p, greedy(8)) for p in prompts]) == want
    assert eng.runner.mailbox.spun >= 3 and eng.runner.mailbox.fell_back == 0
