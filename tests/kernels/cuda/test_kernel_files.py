"""Kernel text in included files: what MLX sees is short, says which shapes the body reads, and
expands back to the text; a kernel built either way computes the same."""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import pytest

from tandem.kernels.cuda import kernel_files
from tests.kernels.cuda.test_paged_attention_cuda import gpu, hang_guard

BODY = """
  // one thread an element; reads the input's length from its shape
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < x_shape[0]) y[i] = __float2half(__half2float(x[i]) * SCALE + __half2float(bias[0]));
"""


@pytest.fixture
def private_dir(tmp_path, monkeypatch):
    d = tmp_path / "k"
    monkeypatch.setenv("TANDEM_KERNEL_DIR", str(d))
    monkeypatch.setattr(kernel_files, "_written", {})
    return d


def _expand(text: str) -> str:
    """What the preprocessor does with the include lines."""
    return re.sub(r'#include "([^"]+)"\n', lambda m: Path(m.group(1)).read_text(), text)


def test_the_short_source_expands_to_the_body_and_names_the_shapes_it_reads(private_dir):
    source, header = kernel_files.short_texts("k", BODY, "constexpr int N = 4;\n", ["x", "bias"])
    assert len(source) < 200 and len(header) < 200
    assert kernel_files.shape_reads(source, ["x", "bias"]) == kernel_files.shape_reads(BODY, ["x", "bias"]) == ["x_shape"]
    assert _expand(source).startswith(BODY)
    assert _expand(header) == "constexpr int N = 4;\n"
    assert oct(private_dir.stat().st_mode & 0o777) == "0o700"


def test_files_are_named_by_their_text_and_written_once(private_dir):
    a = kernel_files.include_line("k", "int a;\n")
    assert kernel_files.include_line("k", "int a;\n") == a
    b = kernel_files.include_line("k", "int b;\n")
    assert a != b and len(list(private_dir.glob("k-*.cuh"))) == 2
    assert not list(private_dir.glob("*.tmp"))


def test_a_file_that_does_not_hold_its_text_is_refused(private_dir):
    line = kernel_files.include_line("k", "int a;\n")
    path = Path(re.search(r'"(.+)"', line).group(1))
    path.write_text("int planted;\n")
    kernel_files._written.clear()
    with pytest.raises(RuntimeError, match="does not hold the kernel text"):
        kernel_files.include_line("k", "int a;\n")


def test_a_directory_others_can_write_is_refused(private_dir):
    private_dir.mkdir(mode=0o700)
    os.chmod(private_dir, 0o777)
    with pytest.raises(RuntimeError, match="not private to this user"):
        kernel_files.include_line("k", "int a;\n")


def test_the_wrapper_hands_mlx_the_texts_it_is_asked_for(private_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: seen.append(kw) or "kernel")
    for include in (False, True):
        k = kernel_files.cuda_kernel(name="k", input_names=["x", "bias"], output_names=["y"],
                                     source=BODY, header="", include=include)
        # MLX's kernel, and the texts it was handed (what a recorder rebuilds it from).
        assert k._fn == "kernel" and (k.spec.source, k.spec.header) == (seen[-1]["source"], seen[-1]["header"])
        assert (k.spec.name, k.spec.input_names, k.spec.output_names) == ("k", ["x", "bias"], ["y"])
    plain, short = seen
    assert plain["source"] == BODY and plain["header"] == ""
    assert short["source"].startswith("#include") and _expand(short["source"]).startswith(BODY)
    assert short["header"] == "" and short["input_names"] == ["x", "bias"] and short["output_names"] == ["y"]


@pytest.mark.gpu
@gpu
@hang_guard
def test_a_kernel_from_included_files_computes_what_the_inline_one_does(private_dir):
    x = mx.random.normal((1000,)).astype(mx.float16)
    bias = mx.array([0.25], dtype=mx.float16)
    outs = []
    for include in (False, True):
        k = kernel_files.cuda_kernel(name=f"tandem_test_include_{int(include)}", input_names=["x", "bias"],
                                     output_names=["y"], source=BODY, header="", include=include)
        (y,) = k(inputs=[x, bias], output_shapes=[x.shape], output_dtypes=[mx.float16],
                 grid=(1024, 1, 1), threadgroup=(256, 1, 1), template=[("SCALE", 3)])
        outs.append(y)
    mx.eval(outs)
    assert mx.array_equal(outs[0], outs[1]).item()
    assert mx.allclose(outs[1], x * 3 + bias[0], atol=1e-2).item()


def test_every_kernel_module_builds_its_kernels_through_the_wrapper():
    """A kernel built with ``mx.fast.cuda_kernel`` directly would have its whole text hashed
    at every launch again."""
    root = Path(kernel_files.__file__).parents[2]  # the whole package: runners build kernels too
    direct = [str(p.relative_to(root)) for p in root.rglob("*.py")
              if p.name != "kernel_files.py" and "mx.fast.cuda_kernel(" in p.read_text()]
    assert direct == []


def test_a_precompiled_kernel_is_recorded_with_its_machine_code_and_scalars(monkeypatch):
    """``w4wgmma``'s cubin launches are seen by a recorder like the other kernels' (the graph
    step captures them): the cubin, inputs, outputs, int scalars, grid and fill."""
    seen = []
    outs = [mx.zeros((2, 4), mx.float16), mx.zeros((1,), mx.float32)]
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: seen.append(kw) or outs)
    x, w = mx.zeros((2, 8), mx.float16), mx.zeros((4, 1), mx.uint32)
    kw = dict(name="k", cubin=b"\x7fELF-k", inputs=[x, w], output_shapes=[(2, 4), (1,)],
              output_dtypes=[mx.float16, mx.float32], scalars=[2, 8], grid=(256, 3, 1),
              threadgroup=(256, 1, 1), shared_memory=70_000)
    assert kernel_files.precompiled_kernel(**kw) is outs  # no recorder: nothing kept
    with kernel_files.recording() as launches:
        got = kernel_files.precompiled_kernel(**kw, init_value=0.0)
    assert got is outs and seen[-1]["compiled_source"] == b"\x7fELF-k" and seen[-1]["ensure_row_contiguous"]
    (ln,) = launches
    assert (ln.spec.name, ln.spec.cubin, ln.spec.shared_memory) == ("k", b"\x7fELF-k", 70_000)
    assert ln.inputs[0] is x and ln.inputs[1] is w and ln.outputs == outs
    assert (ln.scalars, ln.grid, ln.threadgroup, ln.init_value) == ([2, 8], (256, 3, 1), (256, 1, 1), 0.0)


def test_no_kernel_module_calls_mlxs_precompiled_kernels_directly():
    """A cubin launched past ``precompiled_kernel`` would be invisible to the graph step."""
    root = Path(kernel_files.__file__).parents[2]
    direct = [str(p.relative_to(root)) for p in root.rglob("*.py")
              if p.name != "kernel_files.py" and "mx.fast.precompiled_cuda_kernel(" in p.read_text()]
    assert direct == []
