"""The CUDA driver API through ctypes: the calls a captured decode step needs, no more.

MLX owns the device, its memory and its kernels; ``pipeline.graph_step`` replays a one-row
decode step as one CUDA graph of the same kernels, launched on a stream of its own. That
needs a handful of driver calls (load a cubin, launch, capture, copy, events), which this
module binds from ``libcuda.so.1`` with no dependency beyond the driver itself. Every call
is checked: a failure raises :class:`CudaError` with the call's name and the driver's own
error name (``CUDA_ERROR_INVALID_VALUE``...). ctypes releases the GIL around each call, so
a thread waiting on an event does not stop the others.

:func:`driver` returns ``None`` where there is no driver (every CPU machine): callers fall
back to MLX's own launches.
"""

from __future__ import annotations

import ctypes
import functools
import threading

CU_STREAM_NON_BLOCKING = 0x1
CU_STREAM_CAPTURE_MODE_RELAXED = 2  # other threads' CUDA calls are not the capture's business
CU_EVENT_DISABLE_TIMING = 0x2
CUDA_SUCCESS = 0

_ptr = ctypes.c_void_p
_u64 = ctypes.c_uint64


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is its CUresult."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code = call, code


# name -> (argtypes); every function returns CUresult. A tuple of names tries them in turn
# (the _v2 entry points are the ones the CUDA 12/13 headers map the plain names to).
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_ptr), ctypes.c_int],
    "cuCtxSetCurrent": [_ptr],
    "cuModuleLoadData": [ctypes.POINTER(_ptr), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(_ptr), _ptr, ctypes.c_char_p],
    "cuFuncSetAttribute": [_ptr, ctypes.c_int, ctypes.c_int],
    "cuLaunchKernel": [_ptr, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, ctypes.c_uint, _ptr, ctypes.POINTER(_ptr), ctypes.POINTER(_ptr)],
    "cuStreamCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
    "cuStreamSynchronize": [_ptr],
    ("cuStreamBeginCapture_v2", "cuStreamBeginCapture"): [_ptr, ctypes.c_int],
    "cuStreamEndCapture": [_ptr, ctypes.POINTER(_ptr)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_ptr), _ptr, ctypes.c_ulonglong],
    "cuGraphLaunch": [_ptr, _ptr],
    "cuGraphDestroy": [_ptr],
    "cuGraphExecDestroy": [_ptr],
    ("cuMemAlloc_v2", "cuMemAlloc"): [ctypes.POINTER(_u64), ctypes.c_size_t],
    ("cuMemFree_v2", "cuMemFree"): [_u64],
    "cuMemHostAlloc": [ctypes.POINTER(_ptr), ctypes.c_size_t, ctypes.c_uint],
    "cuMemFreeHost": [_ptr],
    ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"): [_u64, _ptr, ctypes.c_size_t, _ptr],
    ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"): [_ptr, _u64, ctypes.c_size_t, _ptr],
    "cuMemsetD8Async": [_u64, ctypes.c_ubyte, ctypes.c_size_t, _ptr],
    "cuEventCreate": [ctypes.POINTER(_ptr), ctypes.c_uint],
    "cuEventRecord": [_ptr, _ptr],
    "cuEventSynchronize": [_ptr],
    "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), _ptr, _ptr],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


class Driver:
    """The bound calls, each raising :class:`CudaError`; handles are plain ints."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._fns = {}
        for names, argtypes in _SIGNATURES.items():
            names = (names,) if isinstance(names, str) else names
            for n in names:
                fn = getattr(lib, n, None)
                if fn is not None:
                    fn.argtypes, fn.restype = argtypes, ctypes.c_int
                    self._fns[names[0]] = (n, fn)
                    break
            else:
                raise OSError(f"libcuda has none of {names}")
        self._ctx_lock = threading.Lock()
        self._ctx: int | None = None

    def call(self, name: str, *args) -> int:
        real, fn = self._fns[name]
        rc = fn(*args)
        if rc != CUDA_SUCCESS:
            err = ctypes.c_char_p()
            self._fns["cuGetErrorName"][1](rc, ctypes.byref(err))
            raise CudaError(real, rc, (err.value or b"unknown").decode())
        return rc

    def bind_context(self, ordinal: int = 0) -> None:
        """Make the device's primary context (the one MLX's runtime calls use) current on
        the calling thread: MLX's pointers are valid in it."""
        with self._ctx_lock:
            if self._ctx is None:
                self.call("cuInit", 0)
                dev = ctypes.c_int()
                self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
                ctx = _ptr()
                self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev.value)
                self._ctx = ctx.value
        self.call("cuCtxSetCurrent", self._ctx)

    def device_attribute(self, attribute: int, ordinal: int = 0) -> int:
        """A ``CU_DEVICE_ATTRIBUTE_*`` value of device ``ordinal``."""
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return self._out("cuDeviceGetAttribute", ctypes.c_int, attribute, dev.value)

    def arch(self) -> str:
        """``sm_<major><minor>`` of device 0."""
        return "sm_%d%d" % (self.device_attribute(75), self.device_attribute(76))  # compute capability

    def _out(self, name: str, kind, *args) -> int:
        v = kind()
        self.call(name, ctypes.byref(v), *args)
        return v.value or 0

    # Thin wrappers, named after the calls.
    def load_module(self, image: bytes) -> int:
        return self._out("cuModuleLoadData", _ptr, image)

    def get_function(self, module: int, mangled: str) -> int:
        return self._out("cuModuleGetFunction", _ptr, module, mangled.encode())

    def stream(self) -> int:
        return self._out("cuStreamCreate", _ptr, CU_STREAM_NON_BLOCKING)

    def event(self, timing: bool = False) -> int:
        return self._out("cuEventCreate", _ptr, 0 if timing else CU_EVENT_DISABLE_TIMING)

    def elapsed_ms(self, start: int, end: int) -> float:
        """Device time between two recorded timing events (both complete), in ms."""
        v = ctypes.c_float()
        self.call("cuEventElapsedTime", ctypes.byref(v), start, end)
        return v.value

    def mem_alloc(self, nbytes: int) -> int:
        return self._out("cuMemAlloc_v2", _u64, max(int(nbytes), 1))

    def host_alloc(self, nbytes: int) -> int:
        return self._out("cuMemHostAlloc", _ptr, int(nbytes), 0)

    def allow_shared(self, func: int, nbytes: int) -> None:
        """Let ``func`` take ``nbytes`` of dynamic shared memory: above 48 KB a launch
        fails unless the function was given leave first (as MLX does for its own)."""
        self.call("cuFuncSetAttribute", func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))

    def launch(self, func: int, grid, block, stream: int, params, shared_bytes: int = 0) -> None:
        self.call("cuLaunchKernel", func, *grid, *block, shared_bytes, stream, params, None)

    def begin_capture(self, stream: int) -> None:
        self.call("cuStreamBeginCapture_v2", stream, CU_STREAM_CAPTURE_MODE_RELAXED)

    def end_capture(self, stream: int) -> int:
        graph = _ptr()
        self.call("cuStreamEndCapture", stream, ctypes.byref(graph))
        return graph.value or 0

    def instantiate(self, graph: int) -> int:
        return self._out("cuGraphInstantiateWithFlags", _ptr, graph, 0)


@functools.cache
def driver() -> Driver | None:
    """The bound driver, or None where ``libcuda.so.1`` is absent or incomplete."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except OSError:
        return None


class KernelParams:
    """A launch's argument block for ``cuLaunchKernel``: one pointer per parameter to a
    value that this object keeps alive (a device address, or an int32 / int64 array
    passed by value, MLX's ``Shape`` / ``Strides``)."""

    def __init__(self, values: list):
        self._keep = []
        ptrs = []
        for v in values:
            if isinstance(v, ctypes.Array):
                cell = v
            elif isinstance(v, tuple) and v and v[0] == "i32":
                cell = ctypes.c_int32(v[1])
            else:
                cell = _u64(int(v))
            self._keep.append(cell)
            ptrs.append(ctypes.cast(ctypes.pointer(cell), _ptr))
        self.array = (_ptr * max(len(ptrs), 1))(*ptrs)
