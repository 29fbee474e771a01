"""`tandem generate`: one prompt through the chat template, streamed to the terminal."""

from __future__ import annotations

import logging
import sys

HELP = "generate a reply to one prompt on this machine (no server), streamed to the terminal"
DESCRIPTION = (
    "Run one prompt through the model's chat template and stream the reply. Greedy "
    "(temperature 0) by default, so the output is reproducible. Uses the default model "
    "(fetched on first use) unless --model is given."
)


def add_arguments(p) -> None:
    p.add_argument("prompt", help="the user message")
    p.add_argument("--model", metavar="PATH", help="mlx-lm model directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--weights", choices=("auto", "dense", "quantized"), help="weight format to run (default: auto = dense on CPU)")
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--system", help="system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=256, help="stop after this many tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--quiet", action="store_true", help="print only the generated text (warnings and errors still go to stderr)")


def run(args) -> int:
    from tandem import config as config_mod
    from tandem.commands import UserError
    from tandem.pipeline.model_store import ModelError, resolve_model

    cfg = config_mod.load(args.config, overrides={"model.path": args.model, "model.weights": args.weights})
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens={args.max_tokens} must be at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature={args.temperature} must be >= 0")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p={args.top_p} must be in (0, 1]")
    if args.quiet:
        logging.getLogger().setLevel(logging.WARNING)  # the loader's and libraries' info lines
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    try:
        from tandem.pipeline.generate import chat_prompt, stream
        from tandem.pipeline.loader import load_model

        loaded = load_model(resolve_model(cfg.model.path, log=log), cfg.model.weights)
    except ModelError as exc:
        raise UserError(str(exc)) from None
    tok = loaded.tokenizer
    prompt = list(tok.encode(args.prompt)) if args.raw else chat_prompt(tok, args.prompt, args.system)
    last = None
    for piece in stream(loaded, prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed):
        sys.stdout.write(piece.text)
        sys.stdout.flush()
        last = piece
    sys.stdout.write("\n")
    if last is not None:
        log(f"[{last.prompt_tokens} prompt tokens at {last.prompt_tps:.1f} tok/s, "
            f"{last.generation_tokens} generated at {last.generation_tps:.1f} tok/s, finish: {last.finish_reason}]")
    return 0
