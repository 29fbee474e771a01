"""The captured one-row step's host side: finding MLX's compiled modules, recording launches,
and the engine's use of a step queued outside MLX (a fake graph step on the CPU; the real
one is tested on the GPU in test_cuda_runner.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tandem.kernels.cuda import captured
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import nvrtc
from tandem.kvtypes import SamplingParams
from tandem.pipeline.runners.cuda import graph_step
from tandem.pipeline.engine import Engine
from tandem.pipeline.settings import EngineSettings
from tests.pipeline.conftest import EOS, oracle, random_prompts


def test_template_constants_are_the_ones_mlx_writes():
    t = [("T", mx.float16), ("K", 4096), ("PAIR", True), ("RES", False), ("U", mx.int32)]
    assert captured.template_lines(t) == ("  using T = __half;\n  constexpr int K = 4096;\n"
                                             "  constexpr bool PAIR = true;\n  constexpr bool RES = false;\n"
                                             "  using U = int32_t;\n")
    with pytest.raises(captured.Unsupported, match="not a type MLX passes"):
        captured.template_lines([("T", object())])


def test_recording_sees_this_threads_calls_inside_the_block_only():
    calls = []

    def fake(**kw):
        calls.append(kw)
        return [mx.array([len(calls)])]

    k = kernel_files._Kernel(fake, kernel_files.KernelSpec("k", ["x"], ["y"], "src", ""))
    x = mx.zeros((2,))
    k(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32])
    with kernel_files.recording() as launches:
        (y,) = k(inputs=[x], template=[("N", 3)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(1,)], output_dtypes=[mx.int32])
        other = threading.Thread(target=k, kwargs=dict(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                                                       output_shapes=[(1,)], output_dtypes=[mx.int32]))
        other.start()
        other.join()
        with kernel_files.recording() as inner:
            k(inputs=[y], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32])
        k(inputs=[y], grid=(2, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32])
    assert len(calls) == 5
    assert [(ln.grid, ln.template) for ln in launches] == [((64, 1, 1), [("N", 3)]), ((2, 1, 1), [])]
    assert launches[0].inputs[0] is x and launches[0].outputs[0] is y and launches[1].inputs[0] is y
    assert len(inner) == 1


def test_a_kernels_spec_keeps_its_dynamic_shared_memory(monkeypatch):
    """A capture launches with the bytes MLX launches with: the tensor-core attention
    carves its K and V tiles out of ``extern __shared__``, and 0 there would overrun them."""
    from tandem.kernels.cuda import paged_attention_cuda as pac

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: kw)  # CPU MLX has no CUDA back-end
    assert pac._attention_kernel.__wrapped__("tc", 70_000).spec.shared_memory == 70_000
    assert kernel_files.cuda_kernel(name="k", input_names=["x"], output_names=["y"], source="y[0] = x[0];",
                                    include=False).spec.shared_memory == 0


class FakeGraphStep:
    """Stands in for GraphStep: computes each step at once through the runner's MLX
    forward and hands the token out as DeviceTokens. Logs launches, syncs and the
    engine's own forwards, so a test can check that MLX never runs on a pending step."""

    failed = rows_failed = verify_failed = None
    rows_limit = verify_limit = graph_step.MAX_ROWS
    applies = graph_step.GraphStep.applies

    def __init__(self, runner):
        self.runner, self.forward = runner, runner.forward
        self.values: list[int] = []
        self.events: list[str] = []
        self.inputs: list[str] = []  # per launch: its token left on the device ("chained") or not
        self.rows: list[int] = []  # per launch: its rows
        self.pending = False
        runner.forward = self._engine_forward

    def _engine_forward(self, rows, inputs):
        self.events.append("mlx-after-pending" if self.pending else "mlx")
        return self.forward(rows, inputs)

    def launch(self, rows, prev):
        chained = isinstance(prev, graph_step.DeviceTokens) and prev._value is None and prev._serial == len(self.values) - 1
        self.inputs.append("chained" if chained else "host")
        self.rows.append(len(rows))
        ids = []
        for r in rows:  # as GraphStep._select: the sequence's token, else the in-flight sample
            if r.start < len(r.seq.tokens):
                ids.append(r.seq.tokens[r.start])
            else:
                vals = prev.tolist() if isinstance(prev, graph_step.DeviceTokens) else np.asarray(prev).reshape(-1).tolist()
                ids.append(vals[r.seq.pending_index])
        logits = self.forward(rows, mx.array(ids, dtype=mx.int32).reshape(-1, 1))
        self.values.append(mx.argmax(logits, axis=-1).tolist())
        self.events.append("graph")
        self.pending = True
        return graph_step.DeviceTokens(self, 0, len(self.values) - 1, len(rows))

    def _read(self, slot, serial):
        return self.values[serial]

    def sync(self):
        self.pending = False
        self.events.append("sync")


def _capture_through(eng, fake: FakeGraphStep) -> FakeGraphStep:
    """Give the engine's runner captured steps, as the CUDA runner has them (pipeline/runner.py)."""
    runner = eng.runner
    runner.can_capture = lambda rows: fake.applies(rows, [r.seq.sampling for r in rows])
    runner.launch_captured, runner.sync = fake.launch, fake.sync
    return fake


@pytest.mark.parametrize("pipelined", [False, True])
def test_engine_decodes_greedy_rows_through_the_graph_step_and_matches(tiny, pipelined):
    prompts = random_prompts(5, 3, 40, seed=11)
    expected = [oracle(tiny, p, 12) for p in prompts]
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    eng._read_back_first = not pipelined
    fake = _capture_through(eng, FakeGraphStep(eng.runner))
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    # One at a time: every decode step is one greedy row.
    got = [eng.generate_many([(p, greedy)])[0] for p in prompts[:2]]
    assert got == expected[:2]
    assert fake.events.count("graph") >= 2 * 10
    # Together, and with a sampled request: rows join and leave, so MLX's steps and
    # captured ones alternate, and the tokens still match.
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=5)
    mixed = eng.generate_many([(p, greedy) for p in prompts[2:]] + [(prompts[0], sampled)])
    assert mixed[:3] == expected[2:]
    alone = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    assert mixed[3] == alone.generate_many([(prompts[0], sampled)])[0]
    assert "mlx-after-pending" not in fake.events
    # Greedy rows only, of several lengths: steps of several rows are captured, rows leave
    # them as they finish, and each row still decodes its own sequence.
    fake.rows.clear()
    lengths = [12, 9, 5, 12, 3]
    got = eng.generate_many([(p, SamplingParams(temperature=0.0, max_tokens=m)) for p, m in zip(prompts, lengths)])
    assert got == [e[:m] for e, m in zip(expected, lengths)]
    assert max(fake.rows) == len(prompts) and min(fake.rows) < len(prompts), fake.rows
    assert "mlx-after-pending" not in fake.events


def test_pipelined_engine_chains_captured_steps_on_the_device(tiny):
    """Each steady captured step is queued with the step before it still unread: the
    GPU then never waits for the engine thread between tokens (H200 run 107: with the
    host's work between steps the token gap was the step plus the thread's 0.08-0.23 ms)."""
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    eng._read_back_first = False
    fake = _capture_through(eng, FakeGraphStep(eng.runner))
    prompt = random_prompts(1, 20, 21, seed=3)[0]
    got = eng.generate_many([(prompt, SamplingParams(temperature=0.0, max_tokens=16))])[0]
    assert got == oracle(tiny, prompt, 16)
    # The prefill's sample comes from MLX; the next 14 decode steps chain, the first may not.
    assert fake.inputs.count("chained") >= len(fake.inputs) - 1 and len(fake.inputs) >= 14, fake.inputs


def _spec(name, inputs, outputs, source, header=""):
    return kernel_files.KernelSpec(name, inputs, outputs, *kernel_files.short_texts(name, source, header, inputs))


def test_kernel_text_declares_what_the_body_reads_in_mlxs_order():
    spec = kernel_files.KernelSpec("k", ["w", "ids"], ["y"], "// reads w_shape ids_ndim\ny[0] = w[0];", "#define H 1\n")
    ln = kernel_files.Launch(spec, [mx.zeros((2, 4), mx.float16), mx.zeros((3,), mx.int32)], [mx.zeros((2,), mx.float32)],
                             [("T", mx.bfloat16), ("N", 7), ("F", False)], (1, 1, 1), (1, 1, 1), None)
    text, layout = captured.kernel_text(ln)
    assert ('extern "C" __global__ void graph_k(const __half* w, const Shape w_shape, '
            'const int32_t* ids, const int ids_ndim, float* y) {\n  using T = __nv_bfloat16;\n'
            '  constexpr int N = 7;\n  constexpr bool F = false;\n\n// reads w_shape ids_ndim\ny[0] = w[0];\n}\n') in text
    assert text.index("#define H 1") < text.index("graph_k(")
    assert layout == [("in", 0), ("shape", 0), ("in", 1), ("ndim", 1), ("out", 0)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_texts_of_real_kernels_compile(tmp_path):
    """The argmax and embedding kernels as the graph step writes them compile for sm_90
    (nvcc here; NVRTC on the GPU machine, whose branch of the prelude differs only in the
    integer typedefs)."""
    from tandem.kernels.cuda import argmax_cuda
    from tandem.kernels.cuda import embed_cuda

    cases = [
        (_spec("tandem_argmax_rows", ["logits"], ["out"], argmax_cuda._SOURCE,
               f"constexpr int THREADS = {argmax_cuda.THREADS};\n"),
         [mx.zeros((1, 1024), mx.float16)], [mx.zeros((1,), mx.int32)], [("T", mx.float16)]),
        (_spec("tandem_quantized_embedding", ["ids", "w", "scales", "biases"], ["out"], embed_cuda._SOURCE),
         [mx.zeros((1,), mx.int32), mx.zeros((8, 128), mx.uint32), mx.zeros((8, 32), mx.float16),
          mx.zeros((8, 32), mx.float16)], [mx.zeros((1, 1024), mx.float16)],
         [("T", mx.float16), ("BITS", 4), ("GS", 32), ("WPR", 128)]),
    ]
    for spec, ins, outs, template in cases:
        text, _ = captured.kernel_text(kernel_files.Launch(spec, ins, outs, template, (1, 1, 1), (1, 1, 1), None))
        src = tmp_path / f"{spec.name}.cu"
        src.write_text(text)
        run = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", str(tmp_path / f"{spec.name}.cubin"), str(src)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]


_CTYPES = {"__half": mx.float16, "__nv_bfloat16": mx.bfloat16, "float": mx.float32, "int32_t": mx.int32,
           "uint32_t": mx.uint32}


def _launch_from_variant(name, source, header, inputs, outputs, template):
    """bench/cuda_compile.py's description of a variant as a recorded launch."""
    tvals = []
    for kind, n, v in template:
        tvals.append((n, _CTYPES[v] if kind == "typename" else (v == "true") if kind == "bool" else int(v)))
    types = dict(_CTYPES, **{n: v for n, v in tvals if isinstance(v, mx.Dtype)})
    spec = _spec(name, [n for n, _ in inputs], [n for n, _ in outputs], source, header)
    return kernel_files.Launch(spec, [mx.zeros((2,), types[t]) for _, t in inputs],
                               [mx.zeros((2,), types[t]) for _, t in outputs], tvals, (1, 1, 1), (1, 1, 1), None)


ONE_ROW_KERNELS = ("embedding __half 4-bit g64", "qgemv-stream-lean qkv+norm c1 h8 p1", "qgemv-stream-lean o+res c1 h8 p1",
                   "qgemv-stream-lean gate/up pair+norm unpack1 c1 h8 p1", "qgemv-stream-lean down+res c1 h4 p4",
                   "decode attention fused __half D=128 staged-merge=true", "multirow norm=True swiglu=False res=False",
                   "argmax __half")


@pytest.mark.skipif(nvrtc.library() is None, reason="needs libnvrtc (the nvidia-cuda-nvrtc wheel)")
def test_one_row_kernels_compile_through_nvrtc_as_the_graph_step_writes_them(tmp_path, monkeypatch):
    """Every kernel of the 8B shape's one-row step, as ``kernel_text`` writes it, compiles
    with NVRTC for sm_90: the compiler the graph step uses on the GPU machine, whose
    environment (no C++ library, none of MLX's headers) nvcc does not reproduce."""
    import importlib.util

    monkeypatch.setenv("TANDEM_KERNEL_DIR", str(tmp_path))
    path = Path(__file__).resolve().parents[4] / "bench" / "cuda_compile.py"
    spec = importlib.util.spec_from_file_location("cuda_compile_for_test", path)
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    monkeypatch.setattr(cc, "variant", lambda *a: a)
    found = {label: args for gen in (cc.embed_variants, cc.qgemv_stream_variants, cc.attention_variants,
                                     cc.multirow_variants, cc.argmax_variants) for label, args in gen()}
    for label in ONE_ROW_KERNELS:
        text, _ = captured.kernel_text(_launch_from_variant(*found[label]))
        try:
            assert nvrtc.compile_cubin(text, "sm_90", "k.cu")[:4] == b"\x7fELF", label
        except nvrtc.CompileError as exc:
            pytest.fail(f"{label}: {exc}")


class FakeDriver:
    """The driver calls GraphStep.launch makes, on a simulated device (bytes at addresses):
    a replay of ``FakeGraph`` gives each row ``(input * 31 + position) % 1000``, its input
    chosen as ``select_ids`` chooses it (the last replay's token in ``tok_dev``, or the one
    in the state)."""

    def __init__(self):
        self.mem: dict[int, bytearray] = {}  # device allocation base -> its bytes
        self._keep, self.uploads, self.launches = [], [], 0

    def bind_context(self):
        pass

    def arch(self):
        return "sm_90"

    def stream(self):
        return 7

    def event(self):
        return 0

    def mem_alloc(self, n):
        addr = 0x100000 * (len(self.mem) + 1)
        self.mem[addr] = bytearray(n)
        return addr

    def host_alloc(self, n):
        buf = ctypes.create_string_buffer(n)
        self._keep.append(buf)
        return ctypes.addressof(buf)

    def _at(self, addr):
        base = max(b for b in self.mem if b <= addr)
        return self.mem[base], addr - base

    def ints(self, addr, n):
        buf, off = self._at(addr)
        return list(np.frombuffer(bytes(buf[off : off + 4 * n]), np.int32))

    def call(self, name, *args):
        if name == "cuMemcpyHtoDAsync_v2":
            dst, src, n, _ = args
            buf, off = self._at(dst)
            buf[off : off + n] = ctypes.string_at(src, n)
            self.uploads.append(dst)
        elif name == "cuGraphLaunch":
            self.launches += 1
            P, nb = FakeGraph.rows, FakeGraph.nb
            state = self.ints(FakeGraph.state, 5 * P + P * nb)
            sel = state[3 * P + P * nb :]
            prev = self.ints(FakeGraph.tok, P + 8)
            out = [((prev[sel[i]] if sel[i] >= 0 else sel[P + i]) * 31 + state[i]) % 1000 for i in range(P)]
            buf, off = self._at(FakeGraph.tok)
            buf[off : off + 4 * P] = np.array(out, np.int32).tobytes()
        elif name == "cuMemcpyDtoHAsync_v2":
            dst, src, n, _ = args
            buf, off = self._at(src)
            ctypes.memmove(dst, bytes(buf[off : off + n]), n)


class FakeGraph:
    tok = state = 0
    rows, nb = 1, 1
    exec = 1


class _Seq:
    def __init__(self, tokens, pending_index=0):
        self.tokens, self.pending_index = tokens, pending_index


class _Row:
    """A decode row at position ``start``: its input is ``token`` if given (the host has
    it), else the in-flight step's sample at ``pending_index``."""

    def __init__(self, start, token=None, pending_index=0, draft=()):
        self.start, self.n, self.draft = start, 1 + len(draft), list(draft)
        tokens = [0] * start + ([token] if token is not None else [])
        self.seq = _Seq(tokens, pending_index)


class _FakeRunner:
    def decode_state(self, rows, padded=None):
        P = padded or len(rows)
        pos = np.zeros(P, np.int32)
        pos[: len(rows)] = [r.start for r in rows]
        return np.concatenate([pos, np.zeros(3 * P, np.int32)]), 1  # positions, slots, lengths, a 1-wide table


def _fake_graphs(g, drv):
    FakeGraph.tok = g.tok_dev

    def graph(P, nb, verify=False):
        FakeGraph.rows, FakeGraph.nb = P, nb
        FakeGraph.state = drv.mem_alloc(4 * (5 * P + P * nb))
        return type("G", (), {"exec": 1, "state_dev": FakeGraph.state})()

    g._graph = graph


def test_launch_chains_tokens_on_the_device_and_reads_back_only_when_it_must(monkeypatch):
    drv = FakeDriver()
    g = graph_step.GraphStep(_FakeRunner(), drv)
    _fake_graphs(g, drv)
    synced = []
    monkeypatch.setattr(mx, "synchronize", lambda *a: synced.append(1))
    want, tok = [], 5
    prev = mx.array([tok], dtype=mx.int32)  # the prefill's sample: an MLX array
    got = []
    for pos in range(10, 30):
        before = prev
        prev = g.launch([_Row(pos)], prev)
        if isinstance(before, graph_step.DeviceTokens):  # read back one step behind, as the engine does
            got.append(before.tolist()[0])
        tok = (tok * 31 + pos) % 1000
        want.append(tok)
    got.append(prev.tolist()[0])
    assert got == want  # every token is the chained value, though none went through the host
    assert len(synced) == 1  # the MLX-made first input only
    # A capture in between (its check writes tok_dev): the next launch reads the token back.
    g._tok_serial = -1
    nxt = g.launch([_Row(30)], prev)
    assert len(synced) == 2 and nxt.tolist()[0] == (want[-1] * 31 + 30) % 1000
    # A token left unread for more launches than the ring holds is refused, not misread.
    stale = nxt
    for pos in range(31, 31 + graph_step.RING + 1):
        nxt = g.launch([_Row(pos)], nxt)
    stale._value = None
    with pytest.raises(RuntimeError, match="overwritten"):
        stale.tolist()


def test_a_step_of_several_rows_takes_each_input_from_the_device_or_the_host(monkeypatch):
    """Rows keep decoding across steps in another order, one joins with a token the host
    has, one leaves: each row's input is its own last token, and the step is padded to its
    row class (5 rows run as 6) with only the real rows' tokens handed out."""
    drv = FakeDriver()
    g = graph_step.GraphStep(_FakeRunner(), drv)
    _fake_graphs(g, drv)
    monkeypatch.setattr(mx, "synchronize", lambda *a: None)
    prev = g.launch([_Row(10, token=1), _Row(20, token=2), _Row(30, token=3)], None)
    first = [(1 * 31 + 10) % 1000, (2 * 31 + 20) % 1000, (3 * 31 + 30) % 1000]
    # The next step: the rows in reverse order (each reads its own index in the step
    # before), and two that join with host tokens.
    rows = [_Row(31, pending_index=2), _Row(21, pending_index=1), _Row(11, pending_index=0),
            _Row(40, token=4), _Row(50, token=5)]
    nxt = g.launch(rows, prev)
    assert FakeGraph.rows == 6 and nxt.shape == (5,)
    assert nxt.tolist() == [(first[2] * 31 + 31) % 1000, (first[1] * 31 + 21) % 1000, (first[0] * 31 + 11) % 1000,
                            (4 * 31 + 40) % 1000, (5 * 31 + 50) % 1000]
    assert prev.tolist() == first  # read back after the next step was queued


class ModelDriver(FakeDriver):
    """A simulated device whose graph replay is the model's own step: it reads each row's
    input as ``select_ids`` would (the token buffer or the state) and writes the argmax of
    ``step(ids)`` into the token buffer, so the real ``GraphStep.launch`` runs under the
    engine with only the device simulated."""

    def __init__(self, step):
        super().__init__()
        self.step, self.replayed, self.padded = step, [], []

    def call(self, name, *args):
        if name != "cuGraphLaunch":
            return super().call(name, *args)
        P, nb = FakeGraph.rows, FakeGraph.nb
        state = self.ints(FakeGraph.state, 5 * P + P * nb)
        sel = state[3 * P + P * nb :]
        prev = self.ints(FakeGraph.tok, graph_step.MAX_ROWS)
        ids = [int(prev[sel[i]]) if sel[i] >= 0 else int(sel[P + i]) for i in range(P)]
        out = self.step(ids)
        self.replayed.append(len(out))
        self.padded.append(P)
        buf, off = self._at(FakeGraph.tok)
        buf[off : off + 4 * len(out)] = np.array(out, np.int32).tobytes()


def _graph_step_on_the_model(eng):
    """The engine's runner given the real :class:`GraphStep`, on a device simulated by the
    model's own forward over each replay's rows (every position of a verifying row)."""
    runner, last = eng.runner, {}

    def decode_state(rows, padded=None):
        last["rows"] = list(rows)
        return _FakeRunner().decode_state(rows, padded)

    def verify_state(rows, padded):
        last["rows"] = list(rows)
        return np.zeros(4 * padded, np.int32), 1

    forward = runner.forward

    def step(ids):
        rows = last["rows"]
        inputs = np.zeros((len(rows), max(r.n for r in rows)), np.int32)
        at = 0
        for i, r in enumerate(rows):
            inputs[i, : r.n] = ids[at : at + r.n]
            at += r.n
        return mx.argmax(forward(rows, mx.array(inputs)), axis=-1).tolist()  # every position's, row by row

    drv = ModelDriver(step)
    runner.decode_state, runner.verify_state = decode_state, verify_state
    g = graph_step.GraphStep(runner, drv)
    _fake_graphs(g, drv)
    runner.can_capture = lambda rows: g.applies(rows, [r.seq.sampling for r in rows])
    runner.launch_captured, runner.sync = g.launch, g.sync
    return g, drv


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_engine_runs_the_graph_steps_own_launch_as_rows_join_and_leave(tiny, pipelined):
    """The engine and the real ``GraphStep.launch`` (input selection, chaining, padding to
    the row class, read-back one step behind) with the device simulated by the model's own
    forward: greedy requests of several lengths, arriving together and later, give mlx-lm's
    tokens, and steps of several rows were replayed."""
    prompts = random_prompts(6, 3, 40, seed=29)
    lengths = [12, 7, 10, 3, 12, 5]
    expected = [oracle(tiny, p, m) for p, m in zip(prompts, lengths)]
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS])
    eng._read_back_first = not pipelined
    g, drv = _graph_step_on_the_model(eng)
    chained, select = [], g._select

    def recording_select(rows, prev, P):
        out = select(rows, prev, P)
        chained.append(out[1])
        return out

    g._select = recording_select
    greedy = [SamplingParams(temperature=0.0, max_tokens=m) for m in lengths]
    eng.start()
    try:
        first = eng.generate_many([(p, sp) for p, sp in zip(prompts[:5], greedy[:5])])  # 5 rows run as 6
        rest = eng.generate_many([(p, sp) for p, sp in zip(prompts[5:], greedy[5:])])
    finally:
        eng.stop()
    assert first + rest == expected
    assert max(drv.replayed) == 5 and len(set(drv.replayed)) > 1 and 6 in drv.padded, (drv.replayed, drv.padded)
    if pipelined:  # steady steps take their inputs on the device, read back one step behind
        assert sum(chained) >= len(chained) // 2, chained


def test_captured_verifying_steps_give_the_tokens_of_greedy_decoding(tiny):
    """Drafts (right and wrong ones, of several lengths) verified through the graph step's
    own launch, the device simulated by the model's forward over each row's positions: the
    output is greedy decoding's, and verifying steps were replayed."""
    from tandem.pipeline.speculation import Speculator, StepTimes
    from tests.pipeline.test_speculation import MixedDrafter

    prompts = random_prompts(4, 3, 30, seed=31)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [oracle(tiny, p, 16, eos=()) for p in prompts]
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS],
                 speculator=Speculator(MixedDrafter(tiny, seed=4), times=StepTimes(0.0, measured=False)))
    _, drv = _graph_step_on_the_model(eng)
    assert eng.generate_many([(p, greedy) for p in prompts]) == want
    spec = eng.speculator.counters
    assert spec.verify_steps > 0 and 0 < spec.accepted < spec.drafted, (spec.verify_steps, spec.accepted, spec.drafted)
    assert max(drv.replayed) > len(prompts)  # a step with more positions than rows: drafts verified
    eng.pool.check()


class FakeCaptureDriver(FakeDriver):
    """Records what a capture launches, its parameters read back through the pointers."""

    def __init__(self):
        super().__init__()
        self.captured, self.names, self.shared, self.allowed = [], {}, {}, {}

    def load_module(self, cubin):
        return len(self.names) + 1

    def get_function(self, module, name):
        self.names[module] = name
        return module

    def begin_capture(self, stream):
        self.capturing = True

    def end_capture(self, stream):
        self.capturing = False
        return 99

    def instantiate(self, graph):
        return 100

    def allow_shared(self, func, nbytes):
        self.allowed[self.names[func]] = nbytes

    def launch(self, func, grid, block, stream, params, shared_bytes=0):
        assert self.capturing
        self.captured.append((self.names[func], grid, block, params))
        self.shared[self.names[func]] = shared_bytes


def test_capture_points_the_step_state_and_token_at_its_own_buffers(monkeypatch):
    """The recorded launches' parameters: every array where MLX put it, except the step
    state's views (into the graph's state buffer, at their offsets), the token input and
    the argmax's output (both the token buffer); shapes by value, grids in blocks."""
    state = mx.array(np.arange(7, dtype=np.int32))  # pos, slot, len, 4 table columns
    tok = mx.array([[3]], dtype=mx.int32)
    w, y = mx.zeros((4, 8), mx.float16), mx.zeros((4,), mx.float16)
    logits, tokens = mx.zeros((1, 64), mx.float16), mx.zeros((1,), mx.int32)
    pos_v, tab_v, ids_v = state[:1], state[3:].reshape(1, 4), tok.reshape(-1)
    spec = lambda name, ins, outs, src, shared=0: kernel_files.KernelSpec(name, ins, outs, src, "", shared)  # noqa: E731
    launches = [
        kernel_files.Launch(spec("a", ["w", "pos", "table", "ids"], ["y"], "// reads w_shape table_ndim", 80_000),
                            [w, pos_v, tab_v, ids_v], [y], [("K", 8)], (8, 1, 1), (4, 1, 1), None),
        kernel_files.Launch(spec("head", ["y"], ["logits"], "logits[0] = y[0];"), [y], [logits], [],
                            (64, 1, 1), (64, 1, 1), None),
        kernel_files.Launch(spec("argmax", ["logits"], ["out"], "// reads logits_shape"), [logits], [tokens],
                            [("T", mx.float16)], (1024, 1, 1), (1024, 1, 1), None)]
    where = {id(state): 0x10000, id(pos_v): 0x10000, id(tab_v): 0x1000C, id(tok): 0x20000, id(ids_v): 0x20000,
             id(w): 0x30000, id(y): 0x40000, id(logits): 0x50000, id(tokens): 0x60000}
    monkeypatch.setattr(graph_step, "device_pointers", lambda arrays: [where[id(a)] for a in arrays])
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda text, arch, name: text.encode())
    drv = FakeCaptureDriver()
    g = graph_step.GraphStep(type("R", (), {})(), drv)
    g._record = lambda P, nb, token, pos, pools, verify=False: (launches, state, tok, tokens, logits)
    graph = g._capture(1, 4, ())

    def ptr(p):
        return ctypes.c_uint64.from_address(p).value

    (na, ga, ba, pa), (_, gh, _, ph), (nm, gm, _, pm) = drv.captured
    assert (na, nm) == ("graph_a", "graph_argmax")
    assert (ga, ba, gh, gm) == ((2, 1, 1), (4, 1, 1), (1, 1, 1), (1, 1, 1))
    sd, arena = graph.state_dev, g._arenas[1][0][0]
    # The step's own outputs live in the row class's arena: y first, the logits beside it
    # (y is still read when the head writes them).
    assert [ptr(pa[0]), ptr(pa[2]), ptr(pa[3]), ptr(pa[5]), ptr(pa[6])] == [0x30000, sd, sd + 12, g.tok_dev, arena]
    assert list((ctypes.c_int32 * 10).from_address(pa[1]))[:3] == [4, 8, 0]  # w_shape
    assert ctypes.c_int32.from_address(pa[4]).value == 2  # table_ndim
    assert [ptr(ph[0]), ptr(ph[1])] == [arena, arena + graph_step.ALIGN]
    assert ptr(pm[0]) == arena + graph_step.ALIGN and list((ctypes.c_int32 * 2).from_address(pm[1])) == [1, 64]
    assert ptr(pm[2]) == g.tok_dev  # the argmax writes the next step's input
    assert graph.logits_ptr == arena + graph_step.ALIGN and graph.exec == 100
    assert not any(a is y or a is logits for a in graph.keep[0])  # the step's outputs are not kept
    # Dynamic shared memory as MLX gives it: each launch its bytes, and leave above 48 KB.
    assert drv.shared == {"graph_a": 80_000, "graph_head": 0, "graph_argmax": 0}
    assert drv.allowed == {"graph_a": 80_000}
    # A step that does not end in the argmax is not captured.
    g._record = lambda P, nb, token, pos, pools, verify=False: (launches[:2], state, tok, tokens, logits)
    with pytest.raises(graph_step.Unsupported, match="argmax"):
        g._capture(1, 4, ())


def test_capture_launches_a_precompiled_kernel_from_its_cubin_with_its_scalars(monkeypatch):
    """A precompiled launch (``w4wgmma``'s) is captured from its own machine code, not a
    text NVRTC compiles: its parameters are the inputs' addresses, the outputs' and the int
    scalars, its fill a memset of every output, its shared memory allowed above 48 KB."""
    state = mx.array(np.arange(7, dtype=np.int32))
    tok = mx.array([[3]], dtype=mx.int32)
    x, w = mx.zeros((1, 8), mx.float16), mx.zeros((4, 1), mx.uint32)
    y, part = mx.zeros((1, 64), mx.float32), mx.zeros((1,), mx.float32)
    logits, tokens = mx.zeros((1, 64), mx.float16), mx.zeros((1,), mx.int32)
    pre = kernel_files.KernelSpec("tandem_w4wg_x", ["in0", "in1"], ["out0", "out1"], "", "", 70_000, b"CUBIN")
    half = kernel_files.KernelSpec("tandem_to_half", ["x"], ["y"], "// reads x_shape", "")
    argmax = kernel_files.KernelSpec("argmax", ["logits"], ["out"], "// reads logits_shape", "")
    launches = [
        kernel_files.Launch(pre, [x, w], [y, part], [], (512, 3, 1), (256, 1, 1), 0.0, [1, 8]),
        kernel_files.Launch(half, [y], [logits], [], (256, 1, 1), (256, 1, 1), None),
        kernel_files.Launch(argmax, [logits], [tokens], [("T", mx.float16)], (1024, 1, 1), (1024, 1, 1), None)]
    where = {id(state): 0x10000, id(tok): 0x20000, id(x): 0x30000, id(w): 0x38000, id(y): 0x40000,
             id(part): 0x48000, id(logits): 0x50000, id(tokens): 0x60000}
    monkeypatch.setattr(graph_step, "device_pointers", lambda arrays: [where[id(a)] for a in arrays])
    compiled = []
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda text, arch, name: compiled.append(name) or text.encode())
    drv = FakeCaptureDriver()
    modules = []
    drv.load_module = lambda cubin: modules.append(cubin) or len(modules)
    fills = []
    drv.call = lambda name, *args: fills.append((name, args[0], args[2])) if name == "cuMemsetD8Async" else 0
    g = graph_step.GraphStep(type("R", (), {})(), drv)
    g._record = lambda P, nb, token, pos, pools, verify=False: (launches, state, tok, tokens, logits)
    g._capture(1, 4, ())

    def ptr(p):
        return ctypes.c_uint64.from_address(p).value

    (name, grid, block, params), _, _ = drv.captured
    assert name == "tandem_w4wg_x" and modules[0] == b"CUBIN" and "tandem_w4wg_x.cu" not in compiled
    assert (grid, block) == ((2, 3, 1), (256, 1, 1))
    arena = g._arenas[1][0][0]
    out0, out1 = ptr(params[2]), ptr(params[3])
    assert [ptr(params[0]), ptr(params[1])] == [0x30000, 0x38000]  # weights and input where MLX put them
    assert arena <= out0 < arena + g._arenas[1][0][1] and arena <= out1 < arena + g._arenas[1][0][1]
    assert [ctypes.c_int32.from_address(params[4]).value, ctypes.c_int32.from_address(params[5]).value] == [1, 8]
    assert sorted(f[1:] for f in fills) == sorted([(out0, 4 * 64), (out1, 4)])
    assert drv.allowed == {"tandem_w4wg_x": 70_000} and drv.shared["tandem_w4wg_x"] == 70_000


@pytest.mark.skipif(nvrtc.library() is None, reason="needs libnvrtc (the nvidia-cuda-nvrtc wheel)")
def test_the_half_cast_of_k_split_sums_compiles_through_nvrtc(tmp_path, monkeypatch):
    """``quantized_matmul.to_half``, which replaced MLX's cast after a K-split product so the
    step stays capturable, as ``kernel_text`` writes it."""
    from tandem.kernels.cuda import quantized_matmul as qmm

    monkeypatch.setenv("TANDEM_KERNEL_DIR", str(tmp_path))
    spec = _spec("tandem_to_half", ["x"], ["y"], qmm._HALF)
    text, layout = captured.kernel_text(kernel_files.Launch(spec, [mx.zeros((2, 4), mx.float32)],
                                                            [mx.zeros((2, 4), mx.float16)], [], (256, 1, 1),
                                                            (256, 1, 1), None))
    assert layout == [("in", 0), ("shape", 0), ("out", 0)]
    assert nvrtc.compile_cubin(text, "sm_90", "k.cu")[:4] == b"\x7fELF"


def test_the_arena_reuses_a_buffer_once_its_last_reader_ran():
    """Outputs live from their launch to their last reader (a view of one counts as a read of
    it); a dead one's range is reused, and the logits stay to the end."""
    spec = kernel_files.KernelSpec("k", ["x"], ["y"], "", "")
    a, b, c, d, logits = (mx.zeros((n,), mx.float16) for n in (1000, 200, 1000, 100, 64))
    view = mx.zeros((1,), mx.float16)  # stands for a reshape of ``a``: its address inside a's
    w = mx.zeros((4,), mx.float16)
    launches = [kernel_files.Launch(spec, ins, outs, [], (1, 1, 1), (1, 1, 1), None)
                for ins, outs in (([w], [a]), ([view], [b]), ([b], [c]), ([c], [d]), ([d], [logits]))]
    ptrs = {id(a): 0x1000, id(view): 0x1100, id(b): 0x3000, id(c): 0x4000, id(d): 0x6000,
            id(logits): 0x7000, id(w): 0x9000}
    offsets, size = graph_step.plan_arena(launches, [a, b, c, d, logits], ptrs, logits)
    A = graph_step.ALIGN
    assert offsets[id(a)] == 0 and offsets[id(b)] == 8 * A  # a (2000 bytes: 8 x 256) read through its view by launch 1
    assert offsets[id(c)] == 0  # a is dead once launch 1 ran: c takes its range
    assert offsets[id(d)] == 8 * A  # b died after launch 2
    assert offsets[id(logits)] == 0  # c died after launch 3
    assert size == 10 * A  # a's 8 blocks and b's 2


def test_prepare_captures_every_width_to_the_bound_and_a_refusal_turns_the_step_off():
    from tandem.pipeline.runners.cuda.runner import table_width

    store = type("S", (), {"block_size": 16})()
    g = graph_step.GraphStep(type("R", (), {"store": store})(), FakeDriver())
    seen = []
    g._graph = lambda P, nb, verify=False: seen.append((P, nb))
    g.prepare(1000)
    widths = [nb for _, nb in seen]
    assert {P for P, _ in seen} == {1}
    assert widths[0] == table_width(1) and widths[-1] * 16 >= 1000 > widths[-2] * 16
    assert widths == sorted(set(widths)) and all(table_width(n) == n for n in widths) and g.failed is None
    # Every row class up to the batch, each over the same widths.
    seen.clear()
    g.prepare(1000, max_rows=10)
    assert sorted({P for P, _ in seen}) == [1, 2, 3, 4, 6, 8, 12] and len(seen) == 7 * len(widths)
    greedy = SamplingParams(temperature=0.0)
    # A refusal at several rows turns off those steps only; at one row, the step.
    g._graph = lambda P, nb, verify=False: (_ for _ in ()).throw(graph_step.Unsupported(f"no {P}")) if P > 1 else None
    g.prepare(1000, max_rows=4)
    assert g.failed is None and g.rows_failed == "no 2"
    assert g.applies([_Row(5)], [greedy]) and not g.applies([_Row(5), _Row(6)], [greedy] * 2)
    # A refusal from 24 rows on (where the products become MLX's GEMMs) keeps the classes below.
    wide = graph_step.GraphStep(type("R", (), {"store": store})(), FakeDriver())
    wide._graph = lambda P, nb, verify=False: (_ for _ in ()).throw(graph_step.Unsupported("gemm")) if P >= 24 else None
    wide.prepare(1000, max_rows=64)
    assert wide.rows_limit == 16 and wide.rows_failed == "gemm"
    assert wide.applies([_Row(5 + i) for i in range(16)], [greedy] * 16)
    assert not wide.applies([_Row(5 + i) for i in range(17)], [greedy] * 17)

    def refuse(P, nb, verify=False):
        raise graph_step.Unsupported("no")

    g._graph = refuse
    g.prepare(1000)
    assert g.failed == "no" and not g.applies([_Row(5)], [greedy])


def test_release_drops_every_graph_and_the_pools_it_kept():
    """Before the store grows, the captured graphs go (each held the old pool arrays)."""
    class Counting(FakeDriver):
        def __init__(self):
            super().__init__()
            self.calls = []

        def call(self, name, *args):
            self.calls.append((name,) + args)
            return super().call(name, *args)

    drv = Counting()
    g = graph_step.GraphStep(type("R", (), {})(), drv)
    pools = (mx.zeros((4,)), mx.zeros((4,)))
    for nb, ex in ((4, 11), (8, 12)):
        g._graphs[(1, nb)] = graph_step._Graph(exec=ex, state_dev=100 + nb, logits_shape=(1,), logits_dtype=mx.float16,
                                                  logits_ptr=0, pools=pools)
    g.release()
    assert not g._graphs
    assert sorted(c[1] for c in drv.calls if c[0] == "cuGraphExecDestroy") == [11, 12]
    assert sorted(c[1] for c in drv.calls if c[0] == "cuMemFree_v2") == [104, 108]
    assert g.failed is None  # released, not refused: widths are captured again when met


class TimedDriver(FakeDriver):
    """FakeDriver with a device clock: a replay takes 2.4 ms, ``idle`` lets the device wait
    for the host, and a timing event records the clock when the stream reaches it."""

    def __init__(self):
        super().__init__()
        self.clock, self.stamps, self._next_event = 0.0, {}, 100

    def event(self, timing=False):
        self._next_event += 1
        return self._next_event

    def idle(self, ms):
        self.clock += ms

    def elapsed_ms(self, start, end):
        return self.stamps[end] - self.stamps[start]

    def call(self, name, *args):
        if name == "cuEventRecord":
            self.stamps[args[0]] = self.clock
        elif name == "cuGraphLaunch":
            self.clock += 2.4
        super().call(name, *args)


def test_timing_gives_each_replays_device_time_and_the_idle_time_before_it(monkeypatch):
    monkeypatch.setenv("TANDEM_GRAPH_TIMING", "1")
    drv = TimedDriver()
    g = graph_step.GraphStep(_FakeRunner(), drv)
    _fake_graphs(g, drv)
    monkeypatch.setattr(mx, "synchronize", lambda *a: None)
    prev, idles = mx.array([5], dtype=mx.int32), [0.0, 0.3, 0.0, 1.25]
    for pos, wait in enumerate(idles):
        drv.idle(wait)  # the host came late: the device sat idle before this launch
        before = prev
        prev = g.launch([_Row(pos)], prev)
        if isinstance(before, graph_step.DeviceTokens):
            before.tolist()
    prev.tolist()
    serials = [t[0] for t in g.timings]
    assert serials == [0, 1, 2, 3]
    assert [round(t[1], 6) for t in g.timings] == [2.4] * 4
    assert g.timings[0][2] is None  # nothing ran before the first
    assert [round(t[2], 6) for t in list(g.timings)[1:]] == idles[1:]
    # A replay read back again adds nothing; one whose predecessor was never read has no idle.
    prev.tolist()
    assert len(g.timings) == 4
    skipped = g.launch([_Row(9)], prev)
    last = g.launch([_Row(10)], skipped)
    last.tolist()
    assert g.timings[-1][0] == 5 and g.timings[-1][2] is None


def test_without_timing_no_timing_event_is_made_or_recorded(monkeypatch):
    monkeypatch.setenv("TANDEM_GRAPH_TIMING", "0")
    drv = TimedDriver()
    g = graph_step.GraphStep(type("R", (), {})(), drv)
    made = drv._next_event - 100
    assert g._marks is None and made == graph_step.RING  # the read-back events only
