"""`tandem edge`: the OpenAI-compatible HTTP edge, gunicorn with the ASGI worker class."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HELP = "run the OpenAI-compatible HTTP edge (gunicorn, Falcon ASGI, SSE)"
DESCRIPTION = (
    "Run the HTTP edge: gunicorn (-k asgi) with its packaged config (tandem/http/gunicorn_conf.py) serving /v1/chat/completions, "
    "/v1/completions, /v1/models, /v1/stats, /health, /ready and /metrics. It loads only the "
    "model's tokenizer and talks to the broker's frontend and token stream. Once it answers "
    "/health it prints one JSON line {\"event\": \"ready\", \"url\": ...} on stdout."
)
# Loaded from the package so an installed tandem (no source checkout) finds it.
CONF = "python:tandem.http.gunicorn_conf"


def add_arguments(p) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--bind", metavar="HOST:PORT", help="listen address (default 127.0.0.1:8000)")
    p.add_argument("--workers", type=int, help="gunicorn worker processes (default: one per 4 CPU cores, 1 to 4)")
    p.add_argument("--model", metavar="PATH", help="mlx-lm model directory whose tokenizer to use (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", metavar="NAME",
                   help="model id clients send and /v1/models lists (default: the model directory's name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (prefer --api-key-file: flags show in ps)")
    p.add_argument("--api-key-file", metavar="PATH", help="file holding the API key")
    p.add_argument("--broker", metavar="ADDR", help="broker frontend (default tcp://127.0.0.1:5555)")
    p.add_argument("--broker-stream", metavar="ADDR", help="broker token stream XPUB (default tcp://127.0.0.1:5558)")
    p.add_argument("--cluster-secret-file", metavar="PATH", help="cluster secret (>= 16 bytes)")
    p.add_argument("--max-request-bytes", type=int, help="largest request body (default 1 MiB)")
    p.add_argument("--access-log", action="store_true", help="log every request to stderr")
    p.add_argument("--dev", action="store_true", help="allow running without a secret when the broker is on loopback")


def _env_name(dotted: str) -> str:
    return "TANDEM_" + dotted.replace(".", "_").upper()


def run(args) -> int:
    from tandem import config as config_mod
    from tandem.commands import UserError
    from tandem.pipeline.model_store import resolve_model
    from tandem.sdnotify import Notifier
    from tandem.supervisor import die_with_parent
    from tandem.wire.secret import require_cluster_secret
    from tandem.wire.sockets import is_loopback

    if args.api_key and args.api_key_file:
        raise UserError("give --api-key or --api-key-file, not both")
    private = Path(tempfile.mkdtemp(prefix="tandem-edge-"))
    try:
        key_file = args.api_key_file
        if args.api_key:
            key_file = str(private / "api-key")
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(args.api_key)
        overrides = {
            "edge.bind": args.bind, "edge.workers": args.workers, "edge.model_name": args.model_name,
            "edge.api_key_file": key_file, "edge.max_request_bytes": args.max_request_bytes,
            "broker.frontend": args.broker, "broker.stream_out": args.broker_stream,
            "security.cluster_secret_file": args.cluster_secret_file, "model.path": args.model,
        }
        cfg = config_mod.load(args.config, overrides=overrides)
        try:
            model = resolve_model(cfg.model.path, log=lambda m: print(m, file=sys.stderr))
        except Exception as exc:
            raise UserError(str(exc)) from None
        overrides["model.path"] = str(model.resolve())
        loopback = is_loopback(cfg.broker.frontend) and is_loopback(cfg.broker.stream_out)
        require_cluster_secret("hybrid" if args.dev else "edge", cfg.security.cluster_secret_file, loopback_only=loopback)
        if cfg.edge.api_key_file and not Path(cfg.edge.api_key_file).is_file():
            raise UserError(f"API key file {cfg.edge.api_key_file} does not exist")

        env = dict(os.environ)
        if args.config:
            env["TANDEM_CONFIG"] = str(Path(args.config).resolve())
        for dotted, value in overrides.items():
            if value is not None:
                env[_env_name(dotted)] = str(value)
        metrics_dir = private / "metrics"
        metrics_dir.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        env["TOKENIZERS_PARALLELISM"] = "false"
        # gunicorn would say READY=1 as soon as its arbiter boots; only this process,
        # after /health answers, may tell systemd the edge is ready.
        env.pop("NOTIFY_SOCKET", None)
        if args.access_log:
            env["TANDEM_EDGE_ACCESS_LOG"] = "1"
        cmd = [sys.executable, "-m", "gunicorn", "-c", CONF]
        # gunicorn must not outlive this process, even when it is killed with SIGKILL.
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        notifier = Notifier()

        def forward(signum, _frame):
            if signum in (signal.SIGTERM, signal.SIGINT):
                notifier.stopping("draining open streams")
            proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        url = f"http://{cfg.edge.bind}"
        if _wait_healthy(proc, url + "/health"):
            print(json.dumps({"event": "ready", "role": "edge", "url": url, "model": cfg.edge.model_name or model.name}), flush=True)
            notifier.ready(f"edge serving {url}")
        return proc.wait()
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 120.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with opener.open(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False
