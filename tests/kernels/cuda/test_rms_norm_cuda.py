"""The rms_norm kernel gives MLX's ``mx.fast.rms_norm`` (the same arithmetic; only the order
of the fp32 sum of squares differs), and its text compiles as the graph step writes it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import captured
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import nvrtc
from tandem.kernels.cuda import rms_norm_cuda
from tests.kernels.cuda.test_paged_attention_cuda import gpu, hang_guard


def _rows(m: int, n: int, dtype, seed: int, scale: float = 2.0):
    mx.random.seed(seed)
    x = (mx.random.normal((m, n)) * scale).astype(dtype)
    w = (1 + 0.1 * mx.random.normal((n,))).astype(dtype)
    mx.eval(x, w)
    return x, w


def test_falls_back_to_mlx_where_the_kernel_does_not_apply(monkeypatch):
    """Off, on the CPU, in fp32 or with a weight of another width: MLX's rms_norm."""
    monkeypatch.setattr(rms_norm_cuda, "ENABLED", True)
    for dtype, n in ((mx.float32, 64), (mx.float16, 64)):
        x, w = _rows(3, n, dtype, seed=n)
        got = rms_norm_cuda.rms_norm(x, w, 1e-5)
        assert got.shape == x.shape and got.dtype == dtype
        assert mx.array_equal(got, mx.fast.rms_norm(x, w, 1e-5)).item()
    x, w = _rows(3, 64, mx.float16, seed=2)
    assert not rms_norm_cuda.applies(x, w[:32])
    monkeypatch.setattr(rms_norm_cuda, "ENABLED", False)
    assert not rms_norm_cuda.applies(x, w)


@pytest.mark.skipif(nvrtc.library() is None, reason="needs libnvrtc (the nvidia-cuda-nvrtc wheel)")
def test_kernel_text_compiles_through_nvrtc_as_the_graph_step_writes_it(tmp_path, monkeypatch):
    """The graph step records this kernel inside decode steps of two rows and more and
    compiles its text with NVRTC for sm_90: it must compile there, for both types."""
    monkeypatch.setenv("TANDEM_KERNEL_DIR", str(tmp_path))
    spec = kernel_files.KernelSpec("tandem_rms_norm", ["x", "w", "eps"], ["out"],
                                   *kernel_files.short_texts("tandem_rms_norm", rms_norm_cuda._SOURCE,
                                                             f"constexpr int THREADS = {rms_norm_cuda.THREADS};\n",
                                                             ["x", "w", "eps"]))
    for dtype in (mx.float16, mx.bfloat16):
        ln = kernel_files.Launch(spec, [mx.zeros((4, 4096), dtype), mx.zeros((4096,), dtype), mx.zeros((1,), mx.float32)],
                                 [mx.zeros((4, 4096), dtype)], [("T", dtype)], (4 * 256, 1, 1), (256, 1, 1), None)
        text, _ = captured.kernel_text(ln)
        try:
            assert nvrtc.compile_cubin(text, "sm_90", "k.cu")[:4] == b"\x7fELF"
        except nvrtc.CompileError as exc:
            pytest.fail(f"{dtype}: {exc}")


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("m,n,dtype", [
    (2, 4096, mx.float16),      # a two-row decode step of the 8B shape
    (16, 4096, mx.bfloat16),
    (512, 4096, mx.float16),    # a 512-token prefill
    (3, 576, mx.float16),       # the default model's width
])
def test_kernel_matches_mlx(m, n, dtype, monkeypatch):
    monkeypatch.setattr(rms_norm_cuda, "ENABLED", True)
    x, w = _rows(m, n, dtype, seed=m + n)
    assert rms_norm_cuda.applies(x, w)
    got, want = rms_norm_cuda.rms_norm(x, w, 1e-5), rms_norm_cuda.rms_norm_reference(x, w, 1e-5)
    mx.eval(got, want)
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
    # The same arithmetic; the sum's order can move the normalizer by an ulp of fp32,
    # which a few outputs show as one ulp of the type.
    tol = 2 ** -9 if dtype == mx.float16 else 2 ** -6
    assert (diff <= tol * mx.abs(want.astype(mx.float32)) + 1e-6).all().item(), diff.max().item()
    assert mx.mean((diff == 0).astype(mx.float32)).item() > 0.99
