"""`tandem model`: fetch, convert and list model directories."""

from __future__ import annotations

import sys
from pathlib import Path

HELP = "fetch the default model, convert a GGUF file, or list models"
DESCRIPTION = (
    "Manage models. `fetch` downloads and converts the default model "
    "(SmolLM2-135M-Instruct, Q4_1) into the user cache; `convert` turns a llama GGUF "
    "file into an mlx-lm model directory; `list` prints each cached model's directory."
)


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    f = sub.add_parser("fetch", help="download and convert the default model (idempotent)")
    f.add_argument("--force", action="store_true", help="fetch again even if it is already there")
    c = sub.add_parser("convert", help="convert a llama-architecture GGUF file into an mlx-lm model directory")
    c.add_argument("gguf", type=Path, help="input .gguf file")
    c.add_argument("out", type=Path, help="output directory (must not exist)")
    sub.add_parser("list", help="print the directory of each cached model")
    sub.add_parser("path", help="print the default model's directory (fetching it if needed)")


def run(args) -> int:
    from tandem.commands import UserError
    from tandem.pipeline import model_store

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    try:
        if args.model_command == "fetch":
            model_store.fetch_default(log=log, force=args.force)
        elif args.model_command == "path":
            print(model_store.resolve_model(None, log=log))
        elif args.model_command == "list":
            models = model_store.list_models()
            if not models:
                log(f"no models in {model_store.models_root()}; run `tandem model fetch`")
            for path in models:
                print(path)
        elif args.model_command == "convert":
            _convert(args.gguf, args.out, log)
    except model_store.ModelError as exc:
        raise UserError(str(exc)) from None
    return 0


def _convert(gguf: Path, out: Path, log) -> None:
    import os
    import shutil
    import tempfile

    from tandem.commands import UserError
    from tandem.pipeline.gguf import GGUFError, convert

    if not gguf.is_file():
        raise UserError(f"{gguf} does not exist")
    if out.exists():
        raise UserError(f"{out} already exists; choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        convert(gguf, work, progress=lambda i, n, what: log(f"[{i + 1}/{n}] {what}"))
        os.rename(work, out)
    except GGUFError as exc:
        raise UserError(str(exc)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"wrote {out}")
