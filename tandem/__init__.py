"""tandem: LLM serving on MLX.

Importing the package selects the CPU BLAS before anything imports ``mlx``: the
``mlx[cpu]`` wheel links the netlib reference BLAS (about 5 GFLOP/s for an fp32
matmul on the development machines), and preloading MKL's ``libmkl_rt`` with
``RTLD_GLOBAL`` makes mlx's ``sgemm`` resolve to MKL instead (about 150 GFLOP/s).
``TANDEM_BLAS=reference`` keeps the stock library; see docs/cpu-performance.md.
On a CPU with AVX-512 it keeps numpy's OpenBLAS (the CPU prefill's products) on its AVX-512
kernels where the environment forces older ones (``tandem._blas.choose_openblas_core``).
It also sets glibc's malloc to one arena with large thresholds (``tandem._malloc``) and
MLX's CUDA graph sizes (``tandem._mlx_cuda``).
"""

from tandem._blas import choose_openblas_core, preload_blas
from tandem._malloc import tune_malloc
from tandem._mlx_cuda import tune_mlx_cuda

__version__ = "0.1.0"

OPENBLAS_REPLACED = choose_openblas_core()  # before anything imports numpy
MALLOC_TUNED = tune_malloc()
MLX_CUDA_SETTINGS = tune_mlx_cuda()
BLAS = preload_blas()
