"""Where an engine prefill's time goes, with no tracer: the GPU's own clock read by marker kernels.

CUPTI doubles the engine thread's encoding (on the H200 its forward 12.8-13.5 ms against
6.4-7.5 untraced), so a traced prefill is host-bound where an untraced one is not, and its
timeline cannot say where the untraced 13.0 ms go when the device's kernels take ~11.6.
Here a one-thread kernel writes the GPU's ``%globaltimer`` (ns) into a small array:

- ``ids``: on the prompt's ids, before the embedding: a root of the prefill's first graph,
  so it runs when the device starts on the prefill;
- ``embed``: on the embedding's output;
- ``eval<k>``: on the first array of every ``mx.async_eval`` of the engine thread: each layer
  handed over (``runners/cuda/runner.PREFILL_EVAL_EVERY``), then the step's sampled token.

The engine thread's calls are marked on the host's clock (``time.perf_counter``), and
``calibrate`` maps the GPU's clock onto it. The markers add ~35 ops and tiny kernels a
prefill (a few us of device time each, ~27 us of MLX encoding each on the host): the
device's figures are the ones to take, the host's are a little slow.

``summarize`` is pure (it is tested on made-up marks); ``Clock`` and ``calibrate`` need CUDA.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:  # _common, also where a test loads this file
    sys.path.append(str(Path(__file__).resolve().parent))
from _common import Patches  # noqa: E402

_SOURCE = r"""
  if (threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = (uint32_t)(t & 0xffffffffull);
    out[1] = (uint32_t)(t >> 32);
  }
"""


@functools.lru_cache(maxsize=1)
def _kernel():
    import mlx.core as mx

    # ensure_row_contiguous off: the input is only a dependency, and must not be copied.
    return mx.fast.cuda_kernel(name="tandem_clock_mark", input_names=["dep"], output_names=["out"],
                               source=_SOURCE, ensure_row_contiguous=False)


def mark(dep):
    """A (2,) uint32 array: the GPU's clock once ``dep`` exists on the device."""
    import mlx.core as mx

    return _kernel()(inputs=[dep], output_shapes=[(2,)], output_dtypes=[mx.uint32],
                     grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]


def device_seconds(pairs: np.ndarray) -> np.ndarray:
    """(n, 2) uint32 (low, high) clock words -> seconds on the GPU's clock."""
    pairs = np.asarray(pairs, np.uint64).reshape(-1, 2)
    return ((pairs[:, 1] << np.uint64(32)) | pairs[:, 0]).astype(np.float64) * 1e-9


def calibrate(tries: int = 40) -> tuple[float, float]:
    """(offset, uncertainty) in seconds: the GPU's clock minus the host's ``perf_counter``.

    A lone marker is evaluated between two host reads; the try with the narrowest window
    places the kernel at its middle, within half its width."""
    import mlx.core as mx

    dep = mx.zeros((1,), mx.int32)
    mx.eval(dep)
    best = None
    for _ in range(tries):
        m = mark(dep)
        t0 = time.perf_counter()
        mx.eval(m)
        t1 = time.perf_counter()
        g = float(device_seconds(np.array(m))[0])
        if best is None or t1 - t0 < best[1] - best[0]:
            best = (t0, t1, g)
    t0, t1, g = best
    return g - (t0 + t1) / 2, (t1 - t0) / 2


class Clock:
    """Marks an engine's prefills while armed (see the module doc). ``rounds`` holds one
    (host marks, device marks) pair a round: host marks are (name, seconds) of the engine
    thread's ``tick``, ``forward``, ``inputs`` (the runner's ``_prefill_inputs``, and ``/end``), ``embed``
    (and ``/end``), ``async_eval`` (and ``/end``), ``read_back/end``; device marks are
    (label, seconds on the host's clock). ``undo()`` puts the originals back."""

    def __init__(self, eng, offset: float):
        import mlx.core as mx

        self.eng, self.offset = eng, offset
        self.armed = False
        self._collected = threading.Event()
        self.host: list[tuple[str, float]] = []
        self._pending: list[tuple[str, object]] = []
        self._sent: list[tuple[str, object]] = []
        self.rounds: list[tuple[list, list]] = []
        self._patches = Patches()
        self._patches.wrap(eng, "_tick", lambda fn: self._marked(fn, "tick"))
        self._patches.wrap(eng.runner, "forward", lambda fn: self._marked(fn, "forward"))
        self._patches.wrap(eng, "_read_back", self._read_back_wrapper)
        if hasattr(eng.runner, "_embed"):  # the CUDA runner's; others mark no embedding
            self._patches.wrap(eng.runner, "_embed", self._embed_wrapper)
        if hasattr(eng.runner, "_prefill_inputs"):
            self._patches.wrap(eng.runner, "_prefill_inputs", lambda fn: self._marked(fn, "inputs", end=True))
        self._async_eval = self._patches.patch(mx, "async_eval", self._async_eval_wrapper)

    def _mine(self) -> bool:
        return self.armed and threading.current_thread() is getattr(self.eng, "_thread", None)

    def _marked(self, fn, name: str, end: bool = False):
        def wrapper(*a, **kw):
            mine = self._mine()
            if mine:
                self.host.append((name, time.perf_counter()))
            out = fn(*a, **kw)
            if mine and end:
                self.host.append((name + "/end", time.perf_counter()))
            return out
        return wrapper

    def _embed_wrapper(self, fn):
        def wrapper(inputs):
            if not self._mine():
                return fn(inputs)
            self.host.append(("embed", time.perf_counter()))
            self._pending.append(("ids", mark(inputs)))
            out = fn(inputs)
            self.host.append(("embed/end", time.perf_counter()))
            self._pending.append(("embed", mark(out)))
            return out
        return wrapper

    def _async_eval_wrapper(self, *arrays):
        if not self._mine() or not arrays:
            return self._async_eval(*arrays)
        self.host.append(("async_eval", time.perf_counter()))
        k = sum(1 for label, _ in self._sent if label.startswith("eval"))
        self._pending.append((f"eval{k}", mark(arrays[0])))
        sent, self._pending = self._pending, []
        self._sent += sent
        out = self._async_eval(*arrays, *[m for _, m in sent])
        self.host.append(("async_eval/end", time.perf_counter()))
        return out

    def _read_back_wrapper(self, fn):
        def wrapper(*a, **kw):
            mine = self._mine()
            out = fn(*a, **kw)
            # The client may have its token (emitted inside fn) and be waiting in
            # ``collected`` already: this round's marks are complete only once read here.
            if mine and self._sent:
                self.host.append(("read_back/end", time.perf_counter()))
                self._collect()
            return out
        return wrapper

    def _collect(self) -> None:
        """The round's device marks, read on the engine thread (their stream's) in one copy."""
        import mlx.core as mx

        if not self._sent:
            return
        labels = [label for label, _ in self._sent]
        words = np.array(mx.concatenate([m for _, m in self._sent]))
        secs = device_seconds(words) - self.offset
        self.rounds.append((list(self.host), list(zip(labels, secs.tolist()))))
        self._sent, self.host = [], []
        self._collected.set()

    def arm(self) -> None:
        self._collected.clear()
        self.host, self._pending, self._sent, self.armed = [], [], [], True

    def collected(self, timeout: float = 5.0) -> bool:
        """Wait until the engine thread has read the armed round's marks."""
        return self._collected.wait(timeout)

    def disarm(self) -> None:
        self.armed = False

    def undo(self) -> None:
        self.armed = False
        self._patches.undo()


def summarize(host: list[tuple[str, float]], device: list[tuple[str, float]], submitted: float,
              returned: float, first_split: bool = False) -> dict:
    """One clocked prefill, in ms from its submit: when the engine thread started its tick
    and the runner's forward, when the device started (``ids``) and finished the embedding,
    each layer and the token, and what the device did after the host had queued everything.

    ``device_idle_ms`` sums, layer by layer, the time the device had finished the layer
    before and the host had not yet handed over the next: the device waiting for the host.
    ``first_split``: layer 0 was handed over in two (``runners/cuda/runner.PREFILL_FIRST_SPLIT``), so the
    first mark is its attention half's (``layer0_attention_ms``) and ``layer_ms`` are whole layers."""
    def ms(t: float) -> float:
        return round((t - submitted) * 1e3, 3)

    def first(name: str) -> float | None:
        return next((t for n, t in host if n == name), None)

    dev = dict(device)
    evals = [(label, t) for label, t in device if label.startswith("eval")]
    queued = [t for n, t in host if n == "async_eval/end"]
    out = {}
    for name in ("tick", "forward", "inputs", "inputs/end", "embed", "embed/end", "async_eval", "async_eval/end",
                 "read_back/end"):
        t = first(name)
        out[name] = None if t is None else ms(t)
    if "ids" not in dev or not evals:
        return out
    start, token = dev["ids"], evals[-1][1]
    layers = [t for _, t in evals[:-1]]
    out.update(device_start=ms(start), embed_done=ms(dev.get("embed", start)), token_done=ms(token),
               returned=ms(returned), device_span_ms=round((token - start) * 1e3, 3),
               embed_ms=round((dev.get("embed", start) - start) * 1e3, 3),
               lead_in_ms=None if first("forward") is None else round((start - first("forward")) * 1e3, 3),
               host_queued_all=ms(queued[-1]) if queued else None)
    if layers:
        ends = [dev.get("embed", start)] + layers
        whole = ends
        if first_split and len(layers) >= 2:
            out["layer0_attention_ms"] = round((ends[1] - ends[0]) * 1e3, 3)
            whole = ends[:1] + ends[2:]
        out["layer_ms"] = [round((b - a) * 1e3, 3) for a, b in zip(whole, whole[1:])]
        out["head_ms"] = round((token - layers[-1]) * 1e3, 3)
        # Layer i was handed over when its async_eval returned (queued[i]); the device
        # finished layer i-1 at ends[i]. Waiting = the part of the gap the host caused.
        idle = [max(0.0, q - e) for q, e in zip(queued, ends)]
        if idle:
            out["device_idle_ms"] = round(sum(idle[1:]) * 1e3, 3)
            out["device_idle_first_ms"] = round(idle[0] * 1e3, 3)
    rb = first("read_back/end")
    if rb is not None:
        out["noticed_after_ms"] = round((rb - token) * 1e3, 3)
    return out
