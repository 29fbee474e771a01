"""Stream one completion straight from the broker (no HTTP), with the synchronous client.

Start a cluster first (`tandem serve`, or `tandem broker` + `tandem worker ...`), then:

    python examples/zmq_stream.py "What is the capital of France?" \
        --cluster-secret-file cluster.secret [--broker tcp://127.0.0.1:5555 --stream tcp://127.0.0.1:5558]

The client subscribes to the request's 16-byte id on the broker's XPUB before it
submits, checks every message's sequence number, and detokenizes incrementally.
"""

from __future__ import annotations

import argparse
import sys

import tandem  # noqa: F401  (selects the BLAS before mlx_lm is imported)
from mlx_lm.utils import load_tokenizer

from tandem.kvtypes import SamplingParams
from tandem.pipeline.model_store import resolve_model
from tandem.wire.client import Busy, Client
from tandem.wire.secret import load_cluster_secret


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--broker", default="tcp://127.0.0.1:5555")
    p.add_argument("--stream", default="tcp://127.0.0.1:5558")
    p.add_argument("--model", help="model directory whose tokenizer to use (default: the default model)")
    p.add_argument("--cluster-secret-file")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()

    tok = load_tokenizer(resolve_model(args.model))
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    detok = tok.detokenizer
    detok.reset()
    with Client(args.broker, args.stream, secret=load_cluster_secret(args.cluster_secret_file)) as client:
        try:
            for event in client.generate(list(prompt), SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
                for t in event.tokens:
                    detok.add_token(t)
                print(detok.last_segment, end="", flush=True)
                if event.finish_reason:
                    detok.finalize()
                    print(detok.last_segment)
                    print(f"[{event.finish_reason}: {event.usage.completion_tokens} tokens]", file=sys.stderr)
        except Busy as exc:
            print(f"cluster busy, retry in {exc.retry_after_s:.1f}s", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
