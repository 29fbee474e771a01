# On the device, sourced at the start of call 2 and later calls (carry .mlxcuda/b in call 2):
# MLX's CUDA wheel installed from its two halves, the dependencies setup.sh installed, one
# PTX cache for the session's processes, and a Python stack from any process that aborts.
if [ ! -d /root/site/mlx ]; then . .mlxcuda/b/install.sh || return 1 2>/dev/null || exit 1; fi
export PYTHONFAULTHANDLER=1 PYTHONPATH=/root/site:/root/site2 PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/root/ptx PATH=/root/site2/bin:$PATH
