"""tandem keeps the prefill's OpenBLAS on its AVX-512 kernels where the environment forces older ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem import _blas

AVX512 = "fpu sse avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {}\n\nprocessor\t: 1\nflags\t\t: {}\n"


def cpuinfo(flags: str) -> str:
    return CPUINFO.format(flags, flags)


def test_a_forced_core_without_avx512_is_replaced_on_a_cpu_with_it():
    assert _blas.openblas_coretype(cpuinfo(AVX512), "Haswell") == "SkylakeX"
    assert _blas.openblas_coretype(cpuinfo(AVX512), "zen") == "SkylakeX"


def test_openblas_own_choice_and_avx512_cores_are_left_alone():
    assert _blas.openblas_coretype(cpuinfo(AVX512), None) is None  # unset: OpenBLAS detects the CPU
    assert _blas.openblas_coretype(cpuinfo(AVX512), "SkylakeX") is None
    assert _blas.openblas_coretype(cpuinfo(AVX512), "cooperlake") is None


def test_a_cpu_without_every_subset_the_kernels_need_keeps_the_forced_core():
    assert _blas.openblas_coretype(cpuinfo("fpu sse avx avx2 fma"), "Haswell") is None
    assert _blas.openblas_coretype(cpuinfo("avx2 fma avx512f avx512dq"), "Haswell") is None  # no bw/vl/cd
    assert _blas.openblas_coretype("", "Haswell") is None


def core_in_subprocess(**env: str) -> str:
    code = "import tandem, numpy; from tandem import _blas; print(_blas.openblas_core())"
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, check=True).stdout.strip()


def cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return _blas.openblas_coretype(f.read(), "Haswell") == "SkylakeX"
    except OSError:
        return False


@pytest.mark.skipif(_blas.openblas_core() is None or not cpu_has_avx512(),
                    reason="needs numpy's bundled OpenBLAS and a CPU with AVX-512")
def test_import_tandem_puts_numpys_openblas_on_avx512_kernels_unless_the_prefill_is_off_it():
    assert core_in_subprocess(OPENBLAS_CORETYPE="Haswell") == "SkylakeX"
    assert core_in_subprocess(OPENBLAS_CORETYPE="Haswell", TANDEM_PREFILL_BLAS="mkl") == "Haswell"
