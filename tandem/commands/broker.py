"""`tandem broker`: the ZeroMQ broker between clients/edges and workers."""

from __future__ import annotations

import json
import signal

HELP = "run the broker (request routing, health, token streams, stats)"
DESCRIPTION = (
    "Run the broker. Clients and the HTTP edge connect to --frontend, workers to --backend "
    "and publish tokens to --stream-in; clients subscribe to --stream-out; `tandem stats` "
    "reads --stats. Every socket is authenticated with the cluster secret (CURVE). When it "
    "is listening it prints one JSON line {\"event\": \"ready\", ...endpoints} on stdout."
)


def add_arguments(p) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--frontend", metavar="ADDR", help="client ROUTER address (default tcp://127.0.0.1:5555)")
    p.add_argument("--backend", metavar="ADDR", help="worker ROUTER address (default tcp://127.0.0.1:5556)")
    p.add_argument("--stream-in", metavar="ADDR", help="XSUB address workers publish to (default tcp://127.0.0.1:5557)")
    p.add_argument("--stream-out", metavar="ADDR", help="XPUB address clients subscribe to (default tcp://127.0.0.1:5558)")
    p.add_argument("--stats", metavar="ADDR", help="stats socket address (default tcp://127.0.0.1:5559)")
    p.add_argument("--strategy", help="round_robin, least_loaded, memory_aware, prompt_length_aware or prefix_aware")
    p.add_argument("--max-queue", type=int, help="queued requests before BUSY")
    p.add_argument("--heartbeat-ms", type=int, help="heartbeat interval")
    p.add_argument("--decode-allowlist", help="comma-separated decode worker names or KV addresses the broker may choose")
    p.add_argument("--stats-verbose", action="store_true", default=None, help="let stats show worker names and addresses (trusted networks only)")
    p.add_argument("--cluster-secret-file", metavar="PATH", help="cluster secret (>= 16 bytes)")
    p.add_argument("--dev", action="store_true", help="allow running without a secret when every address is loopback (hybrid workers only)")


def run(args) -> int:
    from tandem import config as config_mod
    from tandem.broker.broker import Broker
    from tandem.commands import UserError
    from tandem.sdnotify import Notifier, Watchdog
    from tandem.wire.secret import require_cluster_secret
    from tandem.wire.sockets import is_loopback

    cfg = config_mod.load(args.config, overrides={
        "broker.frontend": args.frontend, "broker.backend": args.backend, "broker.stream_in": args.stream_in,
        "broker.stream_out": args.stream_out, "broker.stats": args.stats, "broker.strategy": args.strategy,
        "broker.max_queue": args.max_queue, "broker.heartbeat_interval_ms": args.heartbeat_ms,
        "broker.decode_allowlist": args.decode_allowlist, "broker.stats_verbose": args.stats_verbose,
        "security.cluster_secret_file": args.cluster_secret_file,
    })
    b = cfg.broker
    addrs = [b.frontend, b.backend, b.stream_in, b.stream_out, b.stats]
    secret = require_cluster_secret("hybrid" if args.dev else "broker", cfg.security.cluster_secret_file,
                                    loopback_only=all(is_loopback(a) for a in addrs))
    try:
        broker = Broker(b, secret=secret)
    except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
        raise UserError(f"cannot bind the broker's sockets: {exc}") from None
    notifier = Notifier()

    def _term(*_):
        notifier.stopping()
        broker.stop()

    signal.signal(signal.SIGTERM, _term)
    watchdog = Watchdog(notifier, broker.alive)
    watchdog.start()
    print(json.dumps({"event": "ready", "role": "broker", **broker.endpoints}), flush=True)
    notifier.ready(f"broker: clients {broker.endpoints['frontend']}, workers {broker.endpoints['backend']}")
    try:
        broker.run()
    except KeyboardInterrupt:
        pass
    finally:
        watchdog.stop()
    return 0
