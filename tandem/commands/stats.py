"""`tandem stats`: the broker's view of the cluster as a table (or JSON)."""

from __future__ import annotations

import json
import sys
import time

HELP = "show the broker's stats: workers, load, queue, migrations, refusals"
COLUMNS = ("node", "role", "device", "state", "inflight", "dispatched", "decode_targeted", "running", "waiting",
           "used_blocks", "total_blocks", "refusals", "failures", "kv_handoffs", "kv_sent", "kv_GB/s", "spec_accepted")


def _mb(n) -> str:
    return f"{n / 1e6:.1f}MB" if n else "0"


def _cell(w: dict, key: str) -> str:
    """One table cell; the KV columns are derived from the worker's raw fields."""
    if key == "kv_sent":
        return _mb(w.get("kv_sent_bytes", 0))
    if key == "kv_GB/s":
        # Recent moving average, then the all-time average; '-' until a handoff completed.
        gb_s = w.get("kv_gb_s_recent") if w.get("kv_gb_s_recent") is not None else w.get("kv_gb_s")
        return "-" if gb_s is None else f"{gb_s:.3f}"
    if key == "spec_accepted":  # accepted / drafted tokens of speculative decoding
        drafted = w.get("spec_draft_tokens") or 0
        return "-" if not drafted else f"{w.get('spec_accepted_tokens', 0)}/{drafted}"
    value = w.get(key, "")
    return "" if value is None else str(value)


def add_arguments(p) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--stats", metavar="ADDR", help="the broker's stats socket (default: the running `tandem serve`'s, else tcp://127.0.0.1:5559)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS", help="refresh every SECONDS (default 2)")
    p.add_argument("--verbose-addresses", action="store_true", help="ask for worker addresses (the broker must allow it)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--cluster-secret-file", metavar="PATH", help="default: the running `tandem serve`'s")
    p.add_argument("--state-dir", metavar="DIR", help="where a local `tandem serve` left serve.json (default $XDG_STATE_HOME/tandem)")


def fetch(address: str, secret: bytes | None, timeout_s: float, verbose: bool = False) -> dict:
    import zmq

    from tandem.wire import codec
    from tandem.wire import messages as M
    from tandem.wire.client import Unavailable
    from tandem.wire.sockets import make_socket

    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER, connect=address, security=secret)
    try:
        codec.send(sock, codec.encode(M.StatsRequest(verbose)))
        if not sock.poll(int(timeout_s * 1000)):
            raise Unavailable(f"no answer from the broker's stats socket {address} within {timeout_s:.1f}s")
        msg = codec.decode(codec.recv_frames(sock))
        return msg.stats
    finally:
        sock.close(0)
        ctx.term()


def render(stats: dict) -> str:
    lines = []
    c = stats.get("counters", {})
    lines.append(f"strategy {stats.get('strategy')}  queue {stats.get('queue_depth')}/{stats.get('max_queue')}  "
                 f"running {stats.get('requests', {}).get('running', 0)}  "
                 f"dispatched {c.get('dispatched', 0)}  completed {c.get('completed', 0)}  "
                 f"migrations {c.get('migrations', 0)}  busy {c.get('refused_busy', 0)}  "
                 f"handoffs {c.get('handoffs', 0)}  handoff p50 "
                 + (f"{stats['handoff_ms_p50']:.1f} ms" if stats.get("handoff_ms_p50") is not None else "-"))
    rows = [COLUMNS] + [tuple(_cell(w, k) for k in COLUMNS) for w in stats.get("workers", [])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for r in rows:
        lines.append("  ".join(v.ljust(widths[i]) for i, v in enumerate(r)))
    return "\n".join(lines)


def run(args) -> int:
    from tandem import config as config_mod
    from tandem.commands import UserError
    from tandem.commands import serve_state
    from tandem.wire.client import Unavailable
    from tandem.wire.secret import load_cluster_secret

    found, source = serve_state.overrides(args, {"broker.stats": "stats", "security.cluster_secret_file": "cluster_secret_file"},
                                          serve_state.state_dir(args.state_dir))
    cfg = config_mod.load(args.config, overrides=found)
    secret = load_cluster_secret(cfg.security.cluster_secret_file)
    while True:
        try:
            stats = fetch(cfg.broker.stats, secret, args.timeout, args.verbose_addresses)
        except Unavailable as exc:
            raise UserError(f"{exc} ({source}); is the broker running, with the same cluster secret?") from None
        out = json.dumps(stats, indent=2, sort_keys=True) if args.json else render(stats)
        if args.watch:
            sys.stdout.write("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S") + "\n")
        print(out, flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)
