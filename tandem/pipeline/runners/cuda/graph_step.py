"""Greedy decode steps as CUDA graphs of tandem's kernels, replayed without MLX.

The engine thread, not the GPU, set the decode step: MLX encodes each of a step's ~165
kernel launches in ~8-13 us (a graph node, an output allocation, its eval loop). At one row
that was 1.3-1.9 ms a step against the GPU's 2.37 (docs/benchmarks/gpu_decode.md); at 16-64
rows the host worked ~4.9 ms of a 5.7-6.4 ms step, the GPU waiting. The kernels themselves
need none of that per step: their weights, the KV pools and the attention's tickets live at
fixed addresses, and only the step's tokens and its positions / slots / block table change.

So :class:`GraphStep` runs one decode step of the :class:`~tandem.pipeline.runners.cuda.runner.
KernelRunner` through MLX once per (row class, block-table width) with every kernel call
recorded (``kernels.kernel_files.recording``), keeps what the step reads from outside it
alive (so those buffers stay put), gives the step's own outputs places in one buffer per
row class (``plan_arena``), compiles each kernel's text as MLX would have (``kernel_text``, through
NVRTC: MLX keeps its own modules to itself), and captures the launches, with the same
arguments, into a CUDA graph on a stream of its own. The step's state moves to a device
buffer of its own; the argmax writes the step's tokens into ``tok_dev``, and the next
step's first kernel (``select_ids``) takes each row's input from there (the row's index in
the step before) or from the state (a token the host knows: a row that just joined). So
steady decode is one state copy, one graph launch and one small read-back a step, with the
next step queued before this one's tokens are read. A captured step is checked against
MLX's own step (another token, another position: the same tokens and logits) before it is
used; anything it cannot reproduce raises :class:`Unsupported` and the engine keeps MLX's
path (for steps of several rows, or verifying ones, only those). A step that verifies
greedy rows' drafts is captured the same way, each drafted position a row of its own.

Limits: up to ``MAX_ROWS`` positions, greedy (no temperature, logprobs or logit bias), kernels
made through ``kernel_files.cuda_kernel`` or ``kernel_files.precompiled_kernel`` (whose cubin
is loaded as it is), no MLX ops between kernels (the check catches them: from 17 rows the
layers' products are tandem's only because ``linear.capture_rows`` makes them so). On unless
``engine.decode_graphs`` is off. Replays give exactly the tokens of MLX's launches of the
same row class.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from tandem import knobs
from tandem.kernels.cuda import argmax_cuda
from tandem.kernels.cuda import captured
from tandem.kernels.cuda import cuda_driver
from tandem.kernels.cuda import kernel_files
from tandem.kernels.cuda import nvrtc
from tandem.kernels.cuda.captured import MAX_NDIM, Unsupported, device_pointers, kernel_name, kernel_text
from tandem.pipeline.runners.cuda.tables import decode_rows, row_classes, table_width

log = logging.getLogger("tandem.engine")

# ``TANDEM_GRAPH_TIMING`` (``tandem.knobs``, read when a graph step is made): time every
# replay on the device for the benchmarks (``GraphStep.timings``), its state upload and
# graph between two timing events, and the device's idle time since the replay before.
# CUPTI hides the idle time and its callbacks slow everything after them.
RING = 8  # read-back slots: the engine holds at most two steps in flight
MAX_ROWS = 128  # the widest step captured (row classes of ``tables.decode_rows``)
MAX_GRAPHS = 192  # one per (rows, table width) seen; the oldest goes when a new one would exceed it
MAX_TABLE = 65536  # table entries a step's state may hold (rows x width)


def scratch_state(rows: int, nb: int, pos: int, block_size: int, token: int = 0) -> np.ndarray:
    """A step state of ``rows`` rows whose every table column is the store's scratch block
    0: what a capture runs without touching a sequence. Its layout is the runner's
    (positions, slots, lengths, the table) followed by the input selection (see
    :meth:`GraphStep.launch`): every row's input is ``token`` from the host. Row 0 writes
    its K/V into the scratch block; the others write nowhere (slot -1)."""
    P = rows
    host = np.zeros(5 * P + P * nb, np.int32)
    host[:P] = pos
    host[P : 2 * P] = -1
    host[P] = pos % block_size
    host[2 * P : 3 * P] = pos + 1
    sel = host[3 * P + P * nb :]
    sel[:P] = -1
    sel[P:] = token
    return host


_SELECT = """
  const int n = sel_shape[0] / 2;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const int s = sel[i];
    out[i] = s >= 0 ? prev[s] : sel[n + i];
  }
"""


@functools.cache
def _select_kernel():
    return kernel_files.cuda_kernel(name="tandem_select_ids", input_names=["prev", "sel"], output_names=["out"],
                                    source=_SELECT)


def select_ids(prev: mx.array, sel: mx.array) -> mx.array:
    """A captured step's input tokens, (P, 1) int32: row ``i`` takes ``prev[sel[i]]`` (a
    token the previous replay left on the device) where ``sel[i] >= 0``, else ``sel[P + i]``
    (one the host knows). ``sel``: (2P,) int32."""
    P = sel.shape[0] // 2
    (out,) = _select_kernel()(inputs=[prev, sel], grid=(P, 1, 1), threadgroup=(min(P, 64), 1, 1),
                              output_shapes=[(P, 1)], output_dtypes=[mx.int32])
    return out


def select_ids_reference(prev: mx.array, sel: mx.array) -> mx.array:
    P = sel.shape[0] // 2
    src = sel[:P]
    picked = prev[mx.maximum(src, 0)]
    return mx.where(src >= 0, picked, sel[P:]).astype(mx.int32).reshape(P, 1)


@dataclass
class _Graph:
    exec: int
    state_dev: int  # the step's positions, slots, lengths, table and input selection: (5 + width) x rows int32
    logits_shape: tuple  # the head's output, rewritten by every replay at logits_ptr
    logits_dtype: mx.Dtype
    logits_ptr: int
    pools: tuple
    keep: list = field(default_factory=list)  # every array from outside the step the launches address


ALIGN = 256


class _Outputs:
    """A recorded step's own output buffers by MLX address: which one an address (an array,
    or a view into one) falls in."""

    def __init__(self, produced, ptrs: dict):
        self.spans = sorted((ptrs[id(o)], ptrs[id(o)] + o.nbytes, id(o)) for o in produced)
        self.starts = [a for a, _, _ in self.spans]

    def find(self, p: int) -> tuple[int, int] | None:
        """(the output's id, its start address) for an address inside it; None elsewhere."""
        k = bisect.bisect_right(self.starts, p) - 1
        if k >= 0 and p < self.spans[k][1]:
            return self.spans[k][2], self.spans[k][0]
        return None


def plan_arena(launches, produced, ptrs: dict, logits) -> tuple[dict, int]:
    """Offsets in one buffer for a recorded step's ``produced`` arrays (its launches'
    outputs), each live from the launch that writes it to the last that reads it or a view
    into it (``ptrs``: MLX's addresses, which tell views apart); ``logits`` to the end (the
    check reads them). Returns ({id: offset}, bytes). First fit over freed ranges."""
    outputs = _Outputs(produced, ptrs)
    last = {id(o): -1 for o in produced}
    for i, ln in enumerate(launches):
        for a in ln.inputs:
            hit = outputs.find(ptrs[id(a)])
            if hit is not None:
                last[hit[0]] = i
    last[id(logits)] = len(launches)
    size_of = {id(o): -(-max(o.nbytes, 1) // ALIGN) * ALIGN for o in produced}
    free: list[tuple[int, int]] = []  # (offset, bytes), sorted
    top, offsets, live = 0, {}, []
    for i, ln in enumerate(launches):
        for oid in [x for x in live if last[x] < i]:  # dead before this launch: its range is free
            live.remove(oid)
            free.append((offsets[oid], size_of[oid]))
        free.sort()
        merged: list[tuple[int, int]] = []
        for off, n in free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        free = merged
        for o in ln.outputs:
            oid = id(o)
            if oid not in size_of or oid in offsets:
                continue
            need = size_of[oid]
            for j, (off, n) in enumerate(free):
                if n >= need:
                    offsets[oid] = off
                    free[j] = (off + need, n - need)
                    break
            else:
                offsets[oid], top = top, top + need
            live.append(oid)
        free = [(off, n) for off, n in free if n]
    return offsets, top


class DeviceTokens:
    """A launched step's greedy tokens, read back on first use (``tolist``)."""

    def __init__(self, owner: "GraphStep", slot: int, serial: int, rows: int = 1):
        self._owner, self._slot, self._serial = owner, slot, serial
        self.shape = (rows,)
        self._value: list[int] | None = None

    def tolist(self) -> list[int]:
        if self._value is None:
            self._value = self._owner._read(self._slot, self._serial)[: self.shape[0]]
        return self._value

    def as_mlx(self) -> mx.array:
        return mx.array(np.asarray(self.tolist(), np.int32))


class GraphStep:
    """Captured greedy decode and verifying steps for a :class:`KernelRunner` (see the module doc)."""

    def __init__(self, runner, drv: cuda_driver.Driver):
        self.runner, self.drv = runner, drv
        drv.bind_context()
        self.arch = drv.arch()
        self.stream = drv.stream()
        self.tok_dev = drv.mem_alloc(4 * MAX_ROWS)  # the last replay's tokens, row by row
        self.max_state = 5 * MAX_ROWS + MAX_TABLE
        self._pinned_state = drv.host_alloc(RING * 4 * self.max_state)
        self._pinned_tok = drv.host_alloc(RING * 4 * MAX_ROWS)
        self._slot_rows = [1] * RING
        self._events = [drv.event() for _ in range(RING)]
        # TIMING: per slot, events before the state upload and after the graph; per read
        # replay (its serial, ms from upload to graph end, ms idle since the replay before).
        self._marks = [(drv.event(timing=True), drv.event(timing=True)) for _ in range(RING)] if knobs.GRAPH_TIMING else None
        self.timings: collections.deque = collections.deque(maxlen=4096)
        self._timed = -1  # the last serial whose timing is in ``timings``
        self._modules: list[int] = []
        self._funcs: dict[str, int] = {}  # kernel text -> function
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}  # (rows, table width, verifying) -> graph
        self._arenas: dict[int, list[tuple[int, int]]] = {}  # rows -> [(device buffer, bytes)]
        self._serial = 0
        self._tok_serial = -1  # the launch whose token tok_dev holds
        self._busy = False  # launches queued since the last sync
        self.failed: str | None = None
        # The widest row class captured, and why the next one was not (a product MLX
        # launched, say, which a replay would not run).
        self.rows_limit, self.rows_failed = MAX_ROWS, None
        self.verify_limit, self.verify_failed = MAX_ROWS, None
        self._preparing = False
        self.replays = 0

    # -- the engine's side -------------------------------------------------------------
    def applies(self, rows, params) -> bool:
        """Greedy rows of one token each, or rows that verify drafts (``n`` = 1 + the draft):
        every position a row of the step, ``MAX_ROWS`` at most."""
        if self.failed is not None or not rows or len(params) != len(rows) or not all(p.plain_greedy for p in params):
            return False
        verify = any(r.n > 1 for r in rows)
        if verify and not all(r.n == 1 or r.n == len(r.draft) + 1 for r in rows):
            return False
        positions = sum(r.n for r in rows)
        return positions == 1 or decode_rows(positions) <= (self.verify_limit if verify else self.rows_limit)

    def launch(self, rows, prev) -> DeviceTokens | None:
        """Queue one decode step of ``rows`` (padded to their row class); ``prev``: the
        in-flight step's tokens, a :class:`DeviceTokens` or an MLX array, which the rows
        whose last input is not yet on the host take theirs from. None (and ``failed``,
        ``rows_failed`` or ``verify_failed`` set) when the step cannot be captured."""
        verify = any(r.n > 1 for r in rows)
        B = sum(r.n for r in rows)
        P = decode_rows(B)
        if verify:
            host, nb = self.runner.verify_state(rows, P)
        else:
            host, nb = self.runner.decode_state(rows, P if P != B else None)
        if host.shape[0] + 2 * P > self.max_state:
            return None
        try:
            g = self._graph(P, nb, verify)
        except (Unsupported, cuda_driver.CudaError) as exc:
            self._refuse(exc, P, verify)
            return None
        sel, chained = self._select(rows, prev, P)  # (after a capture, whose check overwrote tok_dev)
        drv, slot = self.drv, self._serial % RING
        drv.bind_context()
        st = self._pinned_state + slot * 4 * self.max_state
        ctypes.memmove(st, host.ctypes.data, host.nbytes)
        ctypes.memmove(st + host.nbytes, sel.ctypes.data, sel.nbytes)
        nbytes = host.nbytes + sel.nbytes
        if self._marks is not None:
            drv.call("cuEventRecord", self._marks[slot][0], self.stream)
        drv.call("cuMemcpyHtoDAsync_v2", g.state_dev, st, nbytes, self.stream)
        if not chained:
            mx.synchronize()  # MLX's steps before this one write the pools this one reads
        drv.call("cuGraphLaunch", g.exec, self.stream)
        if self._marks is not None:
            drv.call("cuEventRecord", self._marks[slot][1], self.stream)
        drv.call("cuMemcpyDtoHAsync_v2", self._pinned_tok + slot * 4 * MAX_ROWS, self.tok_dev, 4 * P, self.stream)
        drv.call("cuEventRecord", self._events[slot], self.stream)
        self._slot_rows[slot] = P
        self._busy = True
        self.replays += 1
        self._tok_serial = self._serial
        self._serial += 1
        return DeviceTokens(self, slot, self._serial - 1, B)

    def _select(self, rows, prev, P: int) -> tuple[np.ndarray, bool]:
        """The step's input selection (``select_ids``, one entry per position: a verifying
        row's drafts follow its last token) and whether it chains on the device:
        a row whose last input is the in-flight step's sample takes it from ``tok_dev``
        where that step was this object's last replay (nothing read back); otherwise every
        input comes from the host, reading ``prev`` back if a row needs it."""
        sel = np.zeros(2 * P, np.int32)
        sel[:P] = -1
        chained = isinstance(prev, DeviceTokens) and prev._owner is self and prev._serial == self._tok_serial
        values = None
        i = 0
        for r in rows:
            tokens = r.seq.tokens
            if r.start < len(tokens):
                sel[P + i] = tokens[r.start]
            elif chained:
                sel[i] = r.seq.pending_index
            else:
                if values is None:
                    values = prev.tolist() if isinstance(prev, DeviceTokens) else np.asarray(prev).reshape(-1).tolist()
                sel[P + i] = values[r.seq.pending_index]
            for j in range(1, r.n):  # a verifying row's drafted positions
                sel[P + i + j] = r.draft[j - 1]
            i += r.n
        return sel, chained

    def sync(self) -> None:
        """Wait for every queued step: MLX work on the pools may follow."""
        if self._busy:
            self.drv.bind_context()
            self.drv.call("cuStreamSynchronize", self.stream)
            self._busy = False

    def release(self) -> None:
        """Drop every captured graph and the pool arrays it keeps alive (the store is about
        to be replaced by a larger one); widths are captured again when next prepared or met."""
        self.sync()
        for key in list(self._graphs):
            self._drop(key)
        for arenas in self._arenas.values():
            for buf, _ in arenas:
                self.drv.call("cuMemFree_v2", buf)
        self._arenas.clear()

    def _read(self, slot: int, serial: int) -> list[int]:
        if self._serial - serial > RING:
            raise RuntimeError(f"graph step {serial}'s token was overwritten (now at {self._serial})")
        self.drv.bind_context()
        self.drv.call("cuEventSynchronize", self._events[slot])
        if self._marks is not None and serial > self._timed:
            self._time(slot, serial)
        return list((ctypes.c_int32 * self._slot_rows[slot]).from_address(self._pinned_tok + slot * 4 * MAX_ROWS))

    def _time(self, slot: int, serial: int) -> None:
        start, end = self._marks[slot]
        busy = self.drv.elapsed_ms(start, end)
        # The replay before is comparable only if it was this launch's predecessor on the
        # stream and its marks are not yet reused (read back within RING launches).
        idle = None
        if serial > 0 and serial == self._timed + 1 and self._serial - (serial - 1) <= RING:
            idle = self.drv.elapsed_ms(self._marks[(serial - 1) % RING][1], start)
        self.timings.append((serial, busy, idle))
        self._timed = serial

    def prepare(self, max_tokens: int, max_rows: int = 1, verify_rows: int = 0) -> None:
        """Capture the steps of every row class up to ``max_rows`` (at most ``MAX_ROWS``) and
        every table width up to ``max_tokens`` of context now: a capture compiles the kernels
        it has not seen (NVRTC, ~1-3 s each the first time on a machine), which mid-decode
        would stall the stream. With ``verify_rows``, the verifying steps of every row class
        from 2 up to that too."""
        bs = self.runner.store.block_size
        t = time.perf_counter()
        self._preparing = True
        try:
            self._prepare(max_tokens, max_rows, bs, False)
            if verify_rows > 1 and self.failed is None:
                self._prepare(max_tokens, verify_rows, bs, True)
        finally:
            self._preparing = False
        log.info("graph step: %d steps (rows up to %d, contexts to %d tokens) captured in %.1f s",
                 len(self._graphs), max(k[0] for k in self._graphs) if self._graphs else 0, max_tokens,
                 time.perf_counter() - t)

    def _prepare(self, max_tokens: int, max_rows: int, bs: int, verify: bool) -> None:
        for P in row_classes(2 if verify else 1, min(max_rows, MAX_ROWS)):
            if P > (self.verify_limit if verify else self.rows_limit):
                break
            nb = table_width(1)
            try:
                while True:
                    self._graph(P, nb, verify)
                    if nb * bs >= max_tokens:
                        break
                    nb = table_width(nb + 1)
            except (Unsupported, cuda_driver.CudaError) as exc:
                self._refuse(exc, P, verify)
                if P == 1:
                    return

    def _refuse(self, exc: Exception, rows: int = 1, verify: bool = False) -> None:
        """Turn the graph step off for good: the engine runs MLX's launches from now on. A
        step of ``rows`` rows (or a verifying one) that cannot be captured turns off that row
        class and the wider ones only."""
        if verify or rows > 1:
            limit = max(c for c in row_classes(1, rows - 1) if c < rows)  # the class below
            if verify:
                self.verify_limit, self.verify_failed = min(self.verify_limit, limit), str(exc)
            else:
                self.rows_limit, self.rows_failed = min(self.rows_limit, limit), str(exc)
            log.warning("captured %s steps of %d rows and more off, MLX's launches instead: %s",
                        "verifying" if verify else "decode", rows, exc)
            return
        self.failed = str(exc)
        log.warning("graph step off, MLX's launches instead: %s", exc)

    # -- capture -----------------------------------------------------------------------
    def _graph(self, P: int, nb: int, verify: bool = False) -> _Graph:
        store = self.runner.store
        pools = tuple(store.keys) + tuple(store.values)
        key = (P, nb, verify)
        g = self._graphs.get(key)
        if g is not None and len(g.pools) == len(pools) and all(a is b for a, b in zip(g.pools, pools)):
            return g
        self.sync()
        if g is not None:  # the store grew: new pools, new addresses
            self._drop(key)
        if len(self._graphs) >= MAX_GRAPHS:
            self._drop(next(iter(self._graphs)))
        t = time.perf_counter()
        self._tok_serial = -1
        g = self._capture(P, nb, pools, verify)
        try:
            self._check(g, P, nb, verify)
        except Exception:
            self.drv.call("cuGraphExecDestroy", g.exec)
            self.drv.call("cuMemFree_v2", g.state_dev)
            raise
        self._graphs[key] = g
        # One line each while serving (a capture there is a stall); prepare sums its own up.
        (log.debug if self._preparing else log.info)(
            "graph step: captured the %d-row %s step for a %d-block table in %.0f ms", P, "verifying" if verify else "decode",
            nb, (time.perf_counter() - t) * 1e3)
        return g

    def _drop(self, key: tuple[int, int, bool]) -> None:
        g = self._graphs.pop(key)
        self.drv.call("cuGraphExecDestroy", g.exec)
        self.drv.call("cuMemFree_v2", g.state_dev)

    def _record(self, P: int, nb: int, token: int, pos: int, pools, verify: bool = False):
        """Run one decode step of ``P`` rows through MLX with every launch recorded:
        (launches, the state array, the previous tokens' array (``tok_dev``'s stand-in), the
        tokens out, logits). Writes land in the scratch block."""
        r = self.runner
        state = mx.array(scratch_state(P, nb, pos, r.store.block_size, token))
        prev = mx.array(np.zeros(P, np.int32))
        mx.eval(state, prev)
        T = 3 * P + P * nb
        with kernel_files.recording() as launches:
            ids = select_ids(prev, state[T:])
            out = r._decode_graph(ids, state[:P], state[P : 2 * P], state[3 * P : T].reshape(P, nb),
                                  state[2 * P : 3 * P], *pools, separate=verify)
            logits = out[0] if isinstance(out, tuple) else out
            if not argmax_cuda.applies(logits):
                raise Unsupported(f"greedy sampling of {logits.dtype} logits is not one kernel")
            tokens = argmax_cuda.argmax_kernel(logits)
        mx.eval(tokens, logits, [x.outputs for x in launches])
        return launches, state, prev, tokens, logits

    def _capture(self, P: int, nb: int, pools, verify: bool = False) -> _Graph:
        drv = self.drv
        mx.synchronize()
        launches, state, tok, tokens, logits = self._record(P, nb, 0, 0, pools, verify)
        if not launches or launches[-1].outputs[0] is not tokens:
            raise Unsupported("the recorded step does not end in the argmax kernel")
        arrays, seen = [], set()
        for ln in launches:
            if ln.init_value not in (None, 0, 0.0):
                raise Unsupported(f"kernel {ln.spec.name} fills its output with {ln.init_value}")
            for a in ln.inputs + ln.outputs:
                if id(a) not in seen:
                    seen.add(id(a))
                    arrays.append(a)
        ptrs = dict(zip(map(id, arrays), device_pointers(arrays)))
        state_ptr, tok_ptr = device_pointers([state, tok])
        state_len = 4 * state.size
        # The step's own outputs (all but the tokens) move into the row class's arena,
        # where buffers whose last reader has run are reused: kept as MLX allocated them,
        # a 128-row step of the 8B shape held ~300 MB, for every table width.
        produced = [o for ln in launches for o in ln.outputs if o is not tokens]
        offsets, size = plan_arena(launches, produced, ptrs, logits)
        arena = self._arena(P, size)
        outputs = _Outputs(produced, ptrs)
        state_dev = drv.mem_alloc(state_len)

        def where(a) -> int:
            p = ptrs[id(a)]
            if state_ptr <= p < state_ptr + state_len:
                return state_dev + (p - state_ptr)
            if tok_ptr <= p < tok_ptr + 4 * P:
                return self.tok_dev + (p - tok_ptr)
            hit = outputs.find(p)
            if hit is not None:  # an output of the step, or a view into one
                return arena + offsets[hit[0]] + (p - hit[1])
            return p

        drv.bind_context()
        plans = []
        for ln in launches:
            if ln.spec.cubin is not None:  # precompiled: inputs, outputs, int scalars
                func = self._cubin_function(ln.spec.cubin, ln.spec.name)
                layout = ([("in", i) for i in range(len(ln.inputs))] + [("out", j) for j in range(len(ln.outputs))]
                          + [("scalar", v) for v in ln.scalars])
            else:
                text, layout = kernel_text(ln)
                func = self._function(text, kernel_name(ln.spec))
            if ln.spec.shared_memory > 48 * 1024:
                drv.allow_shared(func, ln.spec.shared_memory)
            outs_ptrs = [self.tok_dev if o is tokens else where(o) for o in ln.outputs]
            values = []
            for kind, i in layout:
                if kind == "in":
                    values.append(where(ln.inputs[i]))
                elif kind == "out":
                    values.append(outs_ptrs[i])
                elif kind == "scalar":
                    values.append(("i32", i))
                else:
                    a = ln.inputs[i]
                    if a.ndim > MAX_NDIM:
                        raise Unsupported(f"kernel {ln.spec.name}: a {a.ndim}-d input")
                    if kind == "shape":
                        values.append((ctypes.c_int32 * MAX_NDIM)(*a.shape))
                    elif kind == "strides":  # row-contiguous (MLX copies the inputs that are not)
                        values.append((ctypes.c_int64 * MAX_NDIM)(*captured.row_strides(a.shape)))
                    else:
                        values.append(("i32", a.ndim))
            grid = tuple(-(-g // t) for g, t in zip(ln.grid, ln.threadgroup))
            plans.append((func, grid, ln.threadgroup, cuda_driver.KernelParams(values),
                          [(p, o.nbytes) for p, o in zip(outs_ptrs, ln.outputs)] if ln.init_value is not None else [],
                          ln.spec.shared_memory))
        drv.begin_capture(self.stream)
        try:
            for func, grid, block, params, fills, shared in plans:
                for p, n in fills:
                    drv.call("cuMemsetD8Async", p, 0, n, self.stream)
                drv.launch(func, grid, block, self.stream, params.array, shared_bytes=shared)
        finally:
            graph = drv.end_capture(self.stream)
        exec_ = drv.instantiate(graph)
        drv.call("cuGraphDestroy", graph)
        # What the launches read from outside the step (weights, constants) stays alive;
        # the step's own outputs are MLX's to free (the arena holds their replays).
        outside = [a for a in arrays if id(a) not in offsets and a is not tokens]
        return _Graph(exec_, state_dev, logits.shape, logits.dtype, where(logits), pools, [outside, plans])

    def _arena(self, P: int, size: int) -> int:
        """The device buffer the steps of ``P`` rows keep their outputs in (replays run one at
        a time on this object's stream, so every table width shares it); a larger one when a
        step needs more, the smaller kept for the steps already captured in it."""
        arenas = self._arenas.setdefault(P, [])
        if not arenas or arenas[-1][1] < size:
            arenas.append((self.drv.mem_alloc(max(size, 256)), size))
        return arenas[-1][0]

    def _cubin_function(self, cubin: bytes, name: str) -> int:
        f = self._funcs.get(cubin)
        if f is None:
            mod = self.drv.load_module(cubin)
            self._modules.append(mod)
            f = self._funcs[cubin] = self.drv.get_function(mod, name)
        return f

    def _function(self, text: str, name: str) -> int:
        f = self._funcs.get(text)
        if f is None:
            try:
                cubin = nvrtc.compile_cubin(text, self.arch, f"{name}.cu")
            except nvrtc.CompileError as exc:
                raise Unsupported(str(exc)) from None
            f = self._funcs[text] = self._cubin_function(cubin, name)
        return f

    def _check(self, g: _Graph, P: int, nb: int, verify: bool = False) -> None:
        """The captured step against MLX's, at another token and position: the same tokens
        and the same logits, or the graph is not used."""
        token, pos = 1 + (7919 % max(self.runner.embed.weight.shape[0] - 1, 1)), 2
        _, _, _, tokens, logits = self._record(P, nb, token, pos, g.pools, verify)
        want_tok, want = np.array(tokens).reshape(-1), np.array(logits.astype(mx.float32))
        host = scratch_state(P, nb, pos, self.runner.store.block_size, token)
        drv = self.drv
        drv.call("cuMemcpyHtoDAsync_v2", g.state_dev, host.ctypes.data, host.nbytes, self.stream)
        drv.call("cuGraphLaunch", g.exec, self.stream)
        got = np.zeros(g.logits_shape, np.float16 if g.logits_dtype == mx.float16 else np.uint16)
        t = np.zeros(P, np.int32)
        drv.call("cuMemcpyDtoHAsync_v2", got.ctypes.data, g.logits_ptr, got.nbytes, self.stream)
        drv.call("cuMemcpyDtoHAsync_v2", t.ctypes.data, self.tok_dev, t.nbytes, self.stream)
        drv.call("cuStreamSynchronize", self.stream)
        if g.logits_dtype != mx.float16:
            got = (got.astype(np.uint32) << 16).view(np.float32)
        diff = float(np.max(np.abs(got.astype(np.float32) - want)))
        if not np.array_equal(t, want_tok) or not diff <= 1e-3 * max(1.0, float(np.max(np.abs(want)))):
            raise Unsupported(f"the captured {P}-row step differs from MLX's: tokens {t.tolist()} against "
                              f"{want_tok.tolist()}, logits max |diff| {diff:.3g}")


def make(runner) -> GraphStep | None:
    """The graph step for ``runner`` where it can run (CUDA driver present)."""
    drv = cuda_driver.driver()
    if drv is None:
        return None
    try:
        return GraphStep(runner, drv)
    except (cuda_driver.CudaError, OSError) as exc:
        log.warning("graph step off: %s", exc)
        return None
