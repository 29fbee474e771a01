"""`tandem client "prompt"`: stream one completion from the broker to the terminal."""

from __future__ import annotations

import sys

HELP = "send one prompt to a running broker and stream the reply"
DESCRIPTION = (
    "Tokenize the prompt with the model's tokenizer and chat template (the model "
    "directory is read for its tokenizer only, no weights are loaded), submit it to the "
    "broker, and print the reply as tokens arrive. --token-ids sends raw ids instead."
)


def add_arguments(p) -> None:
    p.add_argument("prompt", nargs="?", help="the user message")
    p.add_argument("--token-ids", help="comma-separated prompt token ids (no tokenizer needed)")
    p.add_argument("--config", metavar="FILE", help="TOML config file")
    p.add_argument("--model", metavar="PATH", help="model directory whose tokenizer to use (default: the running `tandem serve`'s, else the bundled model)")
    p.add_argument("--broker", metavar="ADDR", help="broker frontend (default: the running `tandem serve`'s, else tcp://127.0.0.1:5555)")
    p.add_argument("--stream", metavar="ADDR", help="broker XPUB (default: the running `tandem serve`'s, else tcp://127.0.0.1:5558)")
    p.add_argument("--system", help="system message")
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--print-ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the broker")
    p.add_argument("--cluster-secret-file", metavar="PATH", help="default: the running `tandem serve`'s")
    p.add_argument("--state-dir", metavar="DIR", help="where a local `tandem serve` left serve.json (default $XDG_STATE_HOME/tandem)")


def run(args) -> int:
    from tandem import config as config_mod
    from tandem.commands import UserError
    from tandem.commands import serve_state
    from tandem.kvtypes import SamplingParams
    from tandem.wire.client import Busy, Client, InvalidRequest, StreamError, Unavailable
    from tandem.wire.secret import load_cluster_secret

    found, source = serve_state.overrides(args, {"broker.frontend": "broker", "broker.stream_out": "stream",
                                                 "security.cluster_secret_file": "cluster_secret_file",
                                                 "model.path": "model"},
                                          serve_state.state_dir(args.state_dir))
    cfg = config_mod.load(args.config, overrides=found)
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    tok = None
    if args.token_ids:
        try:
            prompt = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise UserError("--token-ids must be comma-separated integers") from None
    elif args.prompt:
        tok = _tokenizer(cfg)
        if args.raw:
            prompt = list(tok.encode(args.prompt))
        else:
            from tandem.pipeline.generate import chat_prompt

            prompt = chat_prompt(tok, args.prompt, args.system)
    else:
        raise UserError("give a prompt or --token-ids")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    secret = load_cluster_secret(cfg.security.cluster_secret_file)
    detok = None
    if tok is not None and not args.print_ids:
        detok = tok.detokenizer
        detok.reset()
    client = Client(cfg.broker.frontend, cfg.broker.stream_out, secret=secret, timeout_s=args.timeout)
    try:
        last = None
        for ev in client.generate(prompt, sampling, priority=args.priority):
            if detok is None:
                sys.stdout.write("".join(f"{t} " for t in ev.tokens))
            else:
                for t in ev.tokens:
                    detok.add_token(t)
                sys.stdout.write(detok.last_segment)
            sys.stdout.flush()
            last = ev
        if detok is not None:
            detok.finalize()
            sys.stdout.write(detok.last_segment)
        # The reply's last line ends before the [finish] line starts, also when stdout
        # and stderr share one pipe (stdout is then block-buffered).
        sys.stdout.write("\n")
        sys.stdout.flush()
        if last is not None and last.usage is not None:
            print(f"[finish: {last.finish_reason}; {last.usage.prompt_tokens} prompt + "
                  f"{last.usage.completion_tokens} generated tokens]", file=sys.stderr)
    except Busy as exc:
        raise UserError(f"broker is busy ({exc}); retry in {exc.retry_after_s:.1f}s") from None
    except Unavailable as exc:
        raise UserError(f"{exc} ({source}); is the broker running, with the same cluster secret?") from None
    except (InvalidRequest, StreamError) as exc:
        raise UserError(str(exc)) from None
    finally:
        client.close()
    return 0


def _tokenizer(cfg):
    from tandem.commands import UserError
    from tandem.pipeline.model_store import ModelError, resolve_model

    try:
        from mlx_lm.utils import load_tokenizer

        return load_tokenizer(resolve_model(cfg.model.path, log=lambda m: print(m, file=sys.stderr)))
    except ModelError as exc:
        raise UserError(str(exc)) from None
