"""gunicorn settings for the tandem edge (`tandem edge` passes this file with -c).

Every value comes from tandem's layered config (TOML < TANDEM_* environment), which
`tandem edge` has already prepared, so `gunicorn -c ops/gunicorn.conf.py` run by hand
(or by systemd) behaves the same as the command.
"""

import os
import tempfile

import tandem  # noqa: F401  (BLAS choice before anything imports mlx)
from tandem import knobs
from tandem.config import load

_config = load()
_edge = _config.edge

# Metrics from every worker land in one directory; `tandem edge` makes a fresh one.
_own_metrics_dir = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _own_metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="tandem-metrics-")
# The tokenizer is loaded before the fork; its Rust thread pool must not be used across it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

wsgi_app = "tandem.http.app:gunicorn_app()"
bind = [_edge.bind]
workers = _edge.worker_count()
worker_class = "tandem.http.edge_worker.EdgeWorker"  # gunicorn's asgi worker; a first request has keepalive seconds to send its headers
worker_connections = _edge.worker_connections
asgi_lifespan = "on"  # each worker starts its own wire client after the fork
asgi_disconnect_grace_period = 1  # a vanished client's request is cancelled (and aborted) after this
# Load the app (tokenizer) once in the master; workers share it copy-on-write.
preload_app = True
# `timeout` is the worker heartbeat: an event loop blocked this long gets the worker killed.
timeout = 30
graceful_timeout = _edge.graceful_timeout_s  # SIGTERM: stop accepting, let open streams finish
keepalive = 5
max_requests = 0
limit_request_line = 8190
accesslog = "-" if knobs.EDGE_ACCESS_LOG else None
errorlog = "-"
loglevel = knobs.EDGE_LOG_LEVEL
proc_name = "tandem-edge"
# One per user by default; several edges (tests, benchmarks) on one host would collide.
control_socket_disable = True


def child_exit(server, worker):
    # A dead worker's live gauges (running/waiting) must stop counting.
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if _own_metrics_dir:
        import shutil

        shutil.rmtree(_own_metrics_dir, ignore_errors=True)
