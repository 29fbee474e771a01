"""The wgmma 4-bit product agrees with dequantize + matmul on fresh random inputs (H200)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tandem.kernels.cuda import quantized_matmul as qm
from tandem.kernels.cuda import nvrtc
from tandem.kernels.cuda import w4gemm
from tandem.kernels.cuda import w4wgmma
from tests.kernels.cuda.four_bit import case, rel_err

gpu = pytest.mark.skipif(not qm.cuda_available(), reason="needs MLX's CUDA backend (sm_90)")
hang_guard = pytest.mark.timeout(180, method="thread")


def test_variants_have_their_own_names_and_declare_what_the_kernel_reads():
    names = {w4wgmma.kernel_source(gs, a, r)[0] for gs in (32, 64) for a in (0, 1) for r in (0, 1)}
    assert len(names) == 8
    name, src = w4wgmma.kernel_source(64, True, False)
    assert f"#define KERNEL_NAME {name}" in src and "constexpr int GS = 64;" in src
    assert "#define OUT_T float" in src and "constexpr bool RES = false;" in src
    assert src.index("typedef unsigned short u16") < src.index("#define OUT_T")


@pytest.mark.skipif(nvrtc.library() is None, reason="needs libnvrtc (the nvidia-cuda-nvrtc wheel)")
def test_variants_compile_for_sm90a_through_nvrtc_and_the_cubin_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_DIR", str(tmp_path))
    w4wgmma.compile_cubin.cache_clear()
    name, cubin = w4wgmma.compile_cubin(64, False, True, min_blocks=2)
    assert cubin[:4] == b"\x7fELF" and name == w4wgmma.kernel_source(64, False, True, min_blocks=2)[0]
    (cached,) = tmp_path.glob("nvrtc-*.cubin")
    assert cached.read_bytes() == cubin
    with pytest.raises(nvrtc.CompileError, match="could not compile"):
        nvrtc.compile_cubin("extern \"C\" __global__ void k() { undefined_thing(); }", "sm_90a")
    w4wgmma.compile_cubin.cache_clear()


def test_support_rules():
    assert w4wgmma.supports(64, 28672, 4096, 64)
    assert w4wgmma.supports(256, 256, 64, 32)
    assert not w4wgmma.supports(257, 256, 64, 64)
    assert not w4wgmma.supports(64, 384, 4096, 64)   # 256-row blocks only
    assert not w4wgmma.supports(64, 4096, 4000, 64)


@gpu
@pytest.mark.gpu
@hang_guard
@pytest.mark.parametrize("variant", [{}, {"min_blocks": 2}], ids=["split", "two-blocks"])
@pytest.mark.parametrize("m,n,k,gs,splits,res", [
    (64, 256, 512, 64, 1, False), (16, 1024, 2048, 64, 1, True), (33, 512, 1024, 32, 4, True),
    (64, 4096, 1024, 64, None, True), (100, 512, 1024, 128, 2, False), (1, 256, 256, 64, 1, False),
    (40, 8192, 4096, 64, None, False),
])
def test_kernel_matches_reference(m, n, k, gs, splits, res, variant):
    x, wq, s, b = case(m, n, k, gs, seed=m + n + k)
    wp, sbp = w4gemm.pack(wq, s, b, gs, 16)
    r = mx.random.normal((m, n)).astype(mx.float16) if res else None
    want = w4gemm.w4_gemm_reference(x, wq, s, b, gs, residual=r)
    for _ in range(2):
        got = w4wgmma.w4_wgmma(x, wp, sbp, gs, residual=r, splits=splits, **variant)
        assert got.shape == want.shape and got.dtype == mx.float16
        assert rel_err(got, want) < 5e-3
