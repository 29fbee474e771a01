"""The `tandem` command: one subcommand per module under tandem/commands/.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors a user can fix are raised as :class:`tandem.commands.UserError`
(or :class:`tandem.config.ConfigError`, :class:`tandem.wire.secret.ClusterSecretError`) and
printed as one line with a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import tandem
from tandem.commands import UserError

COMMANDS = ("serve", "generate", "model", "broker", "worker", "edge", "client", "stats", "bench")


def _load_commands() -> dict:
    modules = {}
    for name in COMMANDS:
        try:
            modules[name] = importlib.import_module(f"tandem.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tandem.commands.{name}":
                raise
    return modules


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="LLM serving on MLX: continuous batching, paged KV cache, disaggregated prefill/decode.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {tandem.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = _load_commands()
    for name, module in modules.items():
        p = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP))
        module.add_arguments(p)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    from tandem.config import ConfigError
    from tandem.wire.secret import ClusterSecretError

    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    try:
        return int(modules[args.command].run(args) or 0)
    except (UserError, ConfigError, ClusterSecretError) as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`tandem stats --json | head`): that ends the output, as
        # it does for any Unix filter. Point stdout at /dev/null so the interpreter's
        # final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
