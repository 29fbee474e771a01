"""Speculative decoding against plain decoding, side by side in one process and one run.

Three workloads on one engine configuration each with speculation off and on (the same
model, requests alternating between the two engines so machine noise falls on both):

- **grounded**, single stream: the output copies its input (rewrite or correct a passage,
  quote from it, edit code), one request at a time;
- **free**, single stream: open-ended writing (little to copy: the adaptive policy should
  switch drafting off);
- **batch**: ``--clients`` clients at once, two requests each one after another (a wide
  batch is compute-bound already and drafts little or nothing).

Temperature 0 throughout, and each speculative output is checked to equal the plain one
token for token. Single-stream speed is decode tokens per second (first token to last,
tokens after the first over that time; the prefill is the same on both sides), with the
end-to-end rate beside it; the batch's is total generated tokens over the wall time.

Drafters: ``ngram`` (prompt lookup, the default), ``draft:PATH``, and two test drafters
for a model with random weights, where nothing predicts the text: ``recorded`` proposes
the target's own greedy continuation (recorded from the plain run first) and ``wrong``
proposes tokens that never match it. With those, the GPU session measures the cost of
verifying k tokens against a decode step (``recorded``) and the policy's back-off
(``wrong``) on the 8B shape (random weights, bench/gpu_serving.py's checkpoint):

    flock /tmp/tandem-bench.lock .venv/bin/python bench/speculative.py --repeats 2     # CPU, default model
    python3 bench/speculative.py --make-model /tmp/m8b --shape 8b --drafter recorded,wrong \
        --workloads grounded,batch --max-tokens 256 --out $OUT/spec-gpu                 # GPU
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, machine, write_results  # noqa: E402

PASSAGE = (
    "The lighthouse at Carrow Point was built in 1847 to warn ships away from the reef that runs "
    "two miles out from the headland. For ninety years a keeper lived in the cottage beside it, "
    "climbing the one hundred and twelve steps each evening to light the lamp and each morning to "
    "trim the wick and polish the lens. The last keeper, Margaret Hale, kept a log of every ship "
    "that passed, every storm that struck the coast and every bird that nested on the gallery. "
    "When the light was automated in 1937 she moved to the village, but she walked out to the "
    "point every Sunday until she died, and her logbooks are now kept in the town library."
)
TYPOS = (
    "The comittee met on tuesday to discus the new budjet. Most members agred that the librery "
    "needed more funding, but there was a long arguement about the swimming pool, which has been "
    "closed since the storm damaged it's roof last winter. In the end they decided to spend half "
    "of the money on the librery and to set aside the rest untill an engineer could inspect the "
    "pool. The next meeting will be held on the first monday of next month in the town hall."
)
CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def average_age(users):
    total = 0
    for user in users:
        total += user["age"]
    return total / len(users)


def users_in_city(users, city):
    return [user for user in users if user["city"] == city]
'''
GROUNDED = [
    "Rewrite the following passage in the past tense, keeping every detail:\n\n" + PASSAGE,
    "Correct the spelling mistakes in this text and return the corrected text:\n\n" + TYPOS,
    "Rename the variable `users` to `people` everywhere in this code and return the whole code:\n\n" + CODE,
    "Summarise this passage in three sentences, quoting its exact words where you can:\n\n" + PASSAGE,
    "Add a docstring to each function in this code and return the whole file:\n\n" + CODE,
    "Repeat the following text exactly, then say how many sentences it has:\n\n" + TYPOS,
]
FREE = [
    "Write a short story about a fox who learns to play the violin.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a birthday party for a seven-year-old.",
    "Write a poem about the sea at night.",
    "What are the pros and cons of working from home?",
    "Describe a day in the life of a medieval blacksmith.",
]


class RecordedDrafter:
    """Proposes the target's recorded greedy continuation of each prompt (test drafter for
    models whose text nothing else predicts)."""

    cost = 0.0

    def __init__(self, recorded: dict[tuple, list[int]], wrong: bool = False, vocab: int = 0):
        self.recorded = recorded  # prompt -> greedy continuation
        self.wrong, self.vocab = wrong, vocab
        self._prompt_of: dict[int, tuple] = {}

    def propose(self, seq, k: int) -> list[int]:
        cont = self.recorded.get(tuple(seq.tokens[: seq.prompt_len]), [])
        done = len(seq.tokens) - seq.prompt_len
        out = cont[done : done + k]
        if self.wrong:  # always different from what the target will pick
            out = [(t + 1) % self.vocab for t in out] or [0] * k
        return out

    def drop(self, serial: int) -> None:
        pass


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def run_one(engine, prompt: list[int], sp) -> tuple[list[int], float, float]:
    """Generate one request alone -> (tokens, seconds from submit to last token, seconds
    from first token to last)."""
    from tandem.pipeline.api import EngineRequest

    done: queue.Queue = queue.Queue()
    out, times = [], []
    t0 = time.perf_counter()
    engine.submit(EngineRequest(uuid.uuid4().bytes, prompt, sp, done.put))
    while True:
        ev = done.get(timeout=600)
        if ev.tokens:
            times.append(time.perf_counter())
            out += ev.tokens
        if ev.finish_reason is not None:
            if ev.finish_reason == "error":
                raise RuntimeError(ev.error)
            break
    end = times[-1] if times else time.perf_counter()
    return out, end - t0, (end - times[0]) if times else 0.0


def single_stream(engines: dict, prompts: list[list[int]], sp, repeats: int) -> dict:
    res = {name: {"tokens": 0, "decode_tokens": 0, "e2e_s": 0.0, "decode_s": 0.0, "outputs": []} for name in engines}
    for rep in range(repeats):
        for p in prompts:
            for name, eng in engines.items():
                toks, e2e, dec = run_one(eng, p, sp)
                r = res[name]
                r["tokens"] += len(toks)
                r["decode_tokens"] += max(0, len(toks) - 1)
                r["e2e_s"] += e2e
                r["decode_s"] += dec
                if rep == 0:
                    r["outputs"].append(toks)
    for r in res.values():
        r["decode_tok_s"] = r["decode_tokens"] / r["decode_s"] if r["decode_s"] else 0.0
        r["e2e_tok_s"] = r["tokens"] / r["e2e_s"] if r["e2e_s"] else 0.0
    return res


def batch(engines: dict, prompts: list[list[int]], sp, clients: int, repeats: int, per_client: int = 2) -> dict:
    """``clients`` clients at once, each sending ``per_client`` requests one after another,
    as serving's clients do: a row that finishes early lets its client's next request in
    (a batch submitted once and waited for whole would end with its slowest row, whatever
    the others gained)."""
    import threading

    res = {name: {"tokens": 0, "wall_s": 0.0, "outputs": None} for name in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            outs: dict[tuple[int, int], list[int]] = {}

            def client(i: int) -> None:
                for r in range(per_client):
                    outs[i, r] = run_one(eng, prompts[(i * per_client + r) % len(prompts)], sp)[0]

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            res[name]["wall_s"] += time.perf_counter() - t
            res[name]["tokens"] += sum(map(len, outs.values()))
            res[name]["outputs"] = [outs[k] for k in sorted(outs)]
    for r in res.values():
        r["tok_s"] = r["tokens"] / r["wall_s"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the default model)")
    ap.add_argument("--make-model", type=Path, help="write bench/gpu_serving.py's random checkpoint of --shape here "
                                                    "(unless it is there) and use it")
    ap.add_argument("--shape", default="8b", help="with --make-model: 8b or tiny")
    ap.add_argument("--drafter", default="ngram", help="comma-separated: ngram, draft:PATH, recorded, wrong")
    ap.add_argument("--workloads", default="grounded,free,batch")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    a = ap.parse_args(argv)
    if a.make_model:
        import gpu_serving

        if not (a.make_model / "config.json").exists():
            gpu_serving.make_model(a.make_model, a.shape, gpu_serving.default_tokenizer_dir())
        a.model = str(a.make_model)

    import mlx.core as mx

    from tandem.kvtypes import SamplingParams
    from tandem.pipeline.engine import Engine
    from tandem.pipeline.loader import load_model
    from tandem.pipeline.model_store import resolve_model
    from tandem.pipeline.settings import EngineSettings, SpeculativeSettings
    from tandem.pipeline.speculation import Speculator, make_speculator

    loaded = load_model(resolve_model(a.model, log=lambda m: None))
    model, tok = loaded.model, loaded.tokenizer
    settings = EngineSettings(kv_cache_budget="2GiB")
    mk = lambda spec=None: Engine(model, settings, model_id=loaded.model_id,  # noqa: E731
                                  eos_token_ids=loaded.eos_token_ids, speculator=spec)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    sets = {"grounded": [encode(tok, t) for t in GROUNDED], "free": [encode(tok, t) for t in FREE]}
    # Before the first engine: on CUDA it replaces the model's layers with its fused blocks,
    # which only its runner can call.
    vocab = int(model(mx.array([[0]])).shape[-1])
    plain = mk()
    plain.start()
    result = {"command": " ".join(["bench/speculative.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": loaded.model_id, "machine": machine(), "max_tokens": a.max_tokens, "runs": []}
    recorded: dict[tuple, list[int]] = {}
    for drafter in a.drafter.split(","):
        if drafter in ("recorded", "wrong"):
            if not recorded:
                for p in sets["grounded"] + sets["free"]:
                    recorded[tuple(p)] = run_one(plain, p, sp)[0]
            spec = Speculator(RecordedDrafter(recorded, wrong=drafter == "wrong", vocab=vocab))
        else:
            spec = make_speculator(SpeculativeSettings(mode=drafter), model)
        fast = mk(spec)
        fast.start()
        engines = {"off": plain, "on": fast}
        run_one(fast, sets["free"][0][:8], SamplingParams(max_tokens=4))  # warm both paths
        for workload in a.workloads.split(","):
            before = fast.stats()
            if workload == "batch":
                r = batch(engines, sets["grounded"] + sets["free"], sp, a.clients, a.repeats)
                ratio = r["on"]["tok_s"] / r["off"]["tok_s"]
            else:
                r = single_stream(engines, sets[workload], sp, a.repeats)
                ratio = r["on"]["decode_tok_s"] / r["off"]["decode_tok_s"]
            after = fast.stats()
            drafted = after.spec_draft_tokens - before.spec_draft_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            same = r["on"]["outputs"] == r["off"]["outputs"]
            for side in r.values():
                side.pop("outputs")
            run = {"drafter": drafter, "workload": workload, "ratio": ratio, "identical": same, "drafted": drafted,
                   "accepted": accepted, "off": r["off"], "on": r["on"]}
            result["runs"].append(run)
            print(f"{drafter:>10} {workload:>8}: {ratio:.2f}x  identical={same}  accepted {accepted}/{drafted}", flush=True)
        fast.stop()
    plain.stop()
    write_results(a.out, "speculative", report(result), result)
    return 0 if all(r["identical"] for r in result["runs"]) else 1


def report(res: dict) -> str:
    lines = [f"# Speculative decoding ({res['model']}, {res['machine']['cpus']} CPUs, load {res['machine']['load_avg_1m']:.1f})", "",
             f"`{res['command']}` ({res['machine']['when']}); temperature 0, up to {res['max_tokens']} tokens a request.", "",
             "| drafter | workload | off tok/s | on tok/s | on / off | accepted / drafted | identical |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in res["runs"]:
        key = "tok_s" if r["workload"] == "batch" else "decode_tok_s"
        acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "0/0"
        lines.append(f"| {r['drafter']} | {r['workload']} | {r['off'][key]:.1f} | {r['on'][key]:.1f} | "
                     f"{r['ratio']:.2f}x | {acc} | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", "Single stream: decode tokens/s (first token to last; the prefill is the same on both sides). "
              "End to end (submit to last token):", ""]
    for r in res["runs"]:
        if r["workload"] != "batch":
            lines.append(f"- {r['drafter']} {r['workload']}: {r['off']['e2e_tok_s']:.1f} -> {r['on']['e2e_tok_s']:.1f} tok/s "
                         f"({r['on']['e2e_tok_s'] / r['off']['e2e_tok_s']:.2f}x)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
