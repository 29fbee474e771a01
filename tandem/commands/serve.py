"""`tandem serve`: the whole stack on this machine (broker, workers, HTTP edge)."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tandem.commands.serve_state import state_dir

HELP = "run the whole stack on this machine: broker, workers and the OpenAI HTTP edge"
DESCRIPTION = (
    "Start a broker, workers and the HTTP edge as child processes on loopback, with a cluster "
    "secret generated in the state directory. The workers: one hybrid worker on a machine with "
    "one GPU, else one prefill and one decode worker (--topology picks; --prefill N --decode M "
    "or --hybrid N for more). "
    "Waits until the edge answers /ready, prints the URL and an example request, and "
    "streams every child's log with its name. A child that dies is restarted; Ctrl-C "
    "or SIGTERM drains and stops everything."
)
# Offsets from --base-port; decode workers take base+10, base+11, ...
PORTS = {"frontend": 0, "backend": 1, "stream_in": 2, "stream_out": 3, "stats": 4}


def console_served(url: str) -> bool:
    """Whether the edge serves the web console (``edge.console`` may turn it off)."""
    try:
        with urllib.request.urlopen(url + "/", timeout=2) as r:
            return r.status == 200 and r.headers.get_content_type() == "text/html"
    except (OSError, ValueError):
        return False


def add_arguments(p) -> None:
    p.add_argument("--model", metavar="PATH", help="mlx-lm model directory (default: the bundled SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--served-model-name", metavar="NAME", help="model id clients send and /v1/models lists (default: the model directory's name)")
    p.add_argument("--weights", choices=("auto", "dense", "quantized"), help="weight format the workers run (default auto)")
    p.add_argument("--config", metavar="FILE", help="TOML config file passed to every child")
    p.add_argument("--topology", choices=("auto", "disaggregated", "hybrid"), default="auto",
                   help="disaggregated: separate prefill and decode workers; hybrid: one worker does both; auto "
                        "(default): hybrid on a machine with one GPU, disaggregated otherwise (or when --prefill / "
                        "--decode is given)")
    p.add_argument("--prefill", type=int, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, metavar="M", help="decode workers (default 1)")
    p.add_argument("--hybrid", type=int, metavar="N", help="hybrid workers with --topology hybrid (default: one per GPU, else 1)")
    p.add_argument("--gpus", metavar="LIST", default="all",
                   help="GPUs to place workers on, each worker on one (CUDA_VISIBLE_DEVICES), in turn: 0,1 or all "
                        "(default: every GPU MLX sees; none on a machine without one) or none")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--base-port", type=int, default=5555, help="first of the ZeroMQ ports (default 5555)")
    p.add_argument("--parallel", type=int, help="active sequences per worker")
    p.add_argument("--speculative", metavar="MODE", help="speculative decoding in the decode workers: auto (the default: ngram on the CPU, off on a GPU), off, ngram (prompt lookup) or draft:PATH (a smaller model with the same tokenizer)")
    p.add_argument("--api-key-file", metavar="PATH", help="require this API key as a Bearer token")
    p.add_argument("--state-dir", metavar="DIR", help="where the generated cluster secret and serve.json (the addresses "
                   "`tandem client` and `tandem stats` find) live (default $XDG_STATE_HOME/tandem)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (the edge's access log)")
    p.add_argument("--no-cpu-gate", action="store_true",
                   help="let decode steps run during prefills (default: the co-located workers share a "
                        "lock file in the state directory so prefills go first)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the stack to come up")


def ensure_secret(directory: Path) -> Path:
    """A cluster secret (32 random bytes, hex-encoded so no line-ending rules apply), mode 0600, created once."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / "cluster-secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.chmod(path, 0o600)
    return path


def check_port_free(host: str, port: int, what: str) -> None:
    from tandem.commands import UserError

    if not 0 < port < 65536:
        raise UserError(f"port {port} for {what} is out of range")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As every server that will bind it does (gunicorn, libzmq): connections that
        # closed a moment ago (TIME_WAIT) do not make the port busy, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise UserError(f"port {port} ({what}) is already in use; pick other ports with --port / --base-port") from None


def visible_gpus(spec: str) -> list[str]:
    """``--gpus``: "all" -> every GPU MLX sees (none on a CPU machine); "none" -> []; "0,1" -> those."""
    from tandem.commands import UserError

    spec = (spec or "all").strip().lower()
    if spec == "none":
        return []
    if spec == "all":
        import mlx.core as mx

        return [str(i) for i in range(mx.device_count(mx.gpu))]
    gpus = [g.strip() for g in spec.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise UserError(f"--gpus {spec!r}: give GPU numbers such as 0,1, or all, or none")
    return gpus


def place(names: list[str], gpus: list[str]) -> dict[str, str]:
    """Each worker's GPU, in turn over ``gpus`` (decode workers first: with one prefill and
    one decode worker on two GPUs, each has a device of its own)."""
    return {name: gpus[i % len(gpus)] for i, name in enumerate(names)} if gpus else {}


def resolve_topology(args, gpus: list[str]) -> str:
    """``--topology auto``: one hybrid worker on a machine with one GPU, a prefill and a decode
    worker otherwise. On one GPU the pair shares the device, so the split keeps no prefill from
    any decode step, while every prompt's KV crosses the sealed channel (device to host, sealed,
    over TCP, opened, host to device: 64 MB for a 512-token prompt of an 8B model) and each
    process holds its own weights: docs/benchmarks/gpu_serving.md measured the pair at a fraction
    of the one worker. On the CPU the pair, gated, serves as much as one worker and keeps each
    role's process small; on two or more GPUs each role gets a device of its own."""
    if args.topology != "auto":
        return args.topology
    if args.prefill is not None or args.decode is not None:
        return "disaggregated"
    return "hybrid" if len(gpus) == 1 else "disaggregated"


def build_specs(args, model: Path, secret: Path, gate: Path | None = None, gpus: list[str] | None = None):
    from tandem.supervisor import ChildSpec

    gpus = gpus or []
    topology = resolve_topology(args, gpus)
    n_prefill, n_decode = args.prefill or 1, args.decode or 1
    tandem = [sys.executable, "-m", "tandem.cli"]
    addr = {k: f"tcp://127.0.0.1:{args.base_port + off}" for k, off in PORTS.items()}
    common = ["--cluster-secret-file", str(secret)] + (["--config", args.config] if args.config else [])
    model_args = ["--model", str(model)] + (["--weights", args.weights] if args.weights else [])
    worker = tandem + ["worker", "--broker-backend", addr["backend"], "--broker-stream", addr["stream_in"]] + common + model_args
    if args.parallel:
        worker += ["--parallel", str(args.parallel)]
    specs = [ChildSpec("broker", tandem + ["broker", "--frontend", addr["frontend"], "--backend", addr["backend"],
                                           "--stream-in", addr["stream_in"], "--stream-out", addr["stream_out"],
                                           "--stats", addr["stats"]] + common)]
    # Prefill workers never decode past the first token: only the others speculate.
    spec = ["--speculative", args.speculative] if args.speculative else []
    if topology == "hybrid":
        roles = {f"hybrid-{i}": ["--role", "hybrid"] + spec for i in range(args.hybrid or max(1, len(gpus)))}
    else:
        roles = {f"decode-{i}": ["--role", "decode", "--kv-bind", f"tcp://127.0.0.1:{args.base_port + 10 + i}"] + spec
                 for i in range(n_decode)}
        roles.update({f"prefill-{i}": ["--role", "prefill"] for i in range(n_prefill)})
        # Workers that share this machine's cores: prefill first, as a hybrid worker's
        # scheduler does (docs/benchmarks/disagg.md: with the gate ~0.97x hybrid's
        # throughput and first tokens within the handoff's time; without it ~0.8x). Workers
        # on GPUs of their own do not wait for each other: that is what the split is for.
        if gate is not None and len(set(place(list(roles), gpus).values())) <= 1:
            worker += ["--cpu-gate", str(gate)]
    where = place(list(roles), gpus)
    for name, role in roles.items():
        # Workers on one device share its memory: each takes an equal share.
        sharing = sum(1 for g in where.values() if g == where[name]) if where else len(roles)
        env = {"CUDA_VISIBLE_DEVICES": where[name]} if where else {}
        specs.append(ChildSpec(name, worker + role + ["--name", name, "--workers-per-device", str(sharing)], env=env))
    edge = tandem + ["edge", "--bind", f"{args.host}:{args.port}", "--broker", addr["frontend"],
                     "--broker-stream", addr["stream_out"], "--model", str(model)] + common
    if args.api_key_file:
        edge += ["--api-key-file", args.api_key_file]
    if args.access_log:
        edge += ["--access-log"]
    if args.served_model_name:
        edge += ["--served-model-name", args.served_model_name]
    specs.append(ChildSpec("edge", edge, stop_grace_s=35.0))
    return specs, addr


def curl_hint(url: str, model: str, api_key_file: str | None) -> str:
    """A request that works when pasted into a shell: with an API key, the header reads
    the key from its file (the key itself never reaches the log)."""
    body = ('{"model": "' + model + '", "stream": true, "temperature": 0, '
            '"messages": [{"role": "user", "content": "What is the capital of France?"}]}')
    cmd = f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'"
    if api_key_file:
        key = shlex.quote(str(Path(api_key_file).resolve()))
        cmd += f' -H "Authorization: Bearer $(cat {key})"'
    return cmd + " -d " + shlex.quote(body)


def wait_ready(url: str, sup, deadline: float) -> None:
    from tandem.supervisor import ChildFailed

    while time.monotonic() < deadline:
        for child in sup.children:
            if child.poll() is not None:
                raise ChildFailed(child.describe_exit())
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if sup.stopping.wait(0.5):
            raise ChildFailed("interrupted during start-up")
    raise ChildFailed(f"{url} did not report ready in time (workers still loading?)")


def run(args) -> int:
    from tandem.commands import UserError
    from tandem.commands.serve_state import publish, withdraw
    from tandem.pipeline.model_store import ModelError, resolve_model
    from tandem.supervisor import ChildFailed, Supervisor

    for name, n in (("--prefill", args.prefill), ("--decode", args.decode), ("--hybrid", args.hybrid)):
        if n is not None and n < 1:
            raise UserError(f"{name}={n} must be at least 1")
    if args.topology == "hybrid" and (args.prefill is not None or args.decode is not None):
        raise UserError("--prefill / --decode name disaggregated workers; --topology hybrid takes --hybrid N")
    gpus = visible_gpus(args.gpus)
    topology = resolve_topology(args, gpus)
    check_port_free(args.host, args.port, "HTTP")
    for what, off in PORTS.items():
        check_port_free("127.0.0.1", args.base_port + off, f"broker {what}, --base-port + {off}")
    if topology == "disaggregated":
        for i in range(args.decode or 1):
            check_port_free("127.0.0.1", args.base_port + 10 + i, f"decode-{i} KV ingest, --base-port + {10 + i}")
    try:
        model = resolve_model(args.model, log=lambda m: print(f"{'serve':>10} | {m}", flush=True))
    except ModelError as exc:
        raise UserError(str(exc)) from None
    if not args.served_model_name and args.model and not Path(args.model).expanduser().exists():
        args.served_model_name = args.model  # a Hugging Face repo id names the model, not its snapshot hash
    secret = ensure_secret(state_dir(args.state_dir))
    gate = None if args.no_cpu_gate else secret.parent / f"cpu-gate-{args.base_port}.lock"
    specs, addr = build_specs(args, model, secret, gate, gpus)
    if args.topology == "auto":
        print(f"{'serve':>10} | topology {topology} (--topology auto: "
              f"{'one GPU' if len(gpus) == 1 else f'{len(gpus)} GPUs' if gpus else 'no GPU'})", flush=True)
    placed = [f"{s.name} on GPU {s.env['CUDA_VISIBLE_DEVICES']}" for s in specs if "CUDA_VISIBLE_DEVICES" in s.env]
    if placed:
        print(f"{'serve':>10} | " + ", ".join(placed), flush=True)
    sup = Supervisor(specs)
    stop = lambda *_: sup.stopping.set()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://{args.host}:{args.port}"
    try:
        sup.say(f"model {model}; cluster secret {secret}")
        deadline = time.monotonic() + args.startup_timeout
        for child in sup.children:
            sup.start(child, ready_timeout_s=max(1.0, deadline - time.monotonic()))
        wait_ready(url + "/ready", sup, deadline)
        publish(secret.parent, addresses=addr, secret=secret, model=model, url=url)
        sup.say(f"ready: {url}/v1  (OpenAI-compatible; Ctrl-C stops everything)")
        if console_served(url):
            sup.say(f"console: {url}/  (chat playground and live cluster view in a browser)")
        sup.say("try: " + curl_hint(url, args.served_model_name or model.name, args.api_key_file))
        while not sup.stopping.wait(0.5):
            sup.check()
    except ChildFailed as exc:
        if not sup.stopping.is_set():
            sup.stop_all()
            print(f"tandem serve: {exc}", file=sys.stderr)
            return 1
    finally:
        withdraw(secret.parent)
        sup.stop_all()
    sup.say("stopped")
    return 0
