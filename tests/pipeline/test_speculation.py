"""Speculative decoding in the batch: the same tokens as without it, blocks all returned.

The drafters here: the tiny model drafting for itself (every draft accepted at
temperature 0), prompt lookup, and a random mixture of right and wrong drafts."""

from __future__ import annotations

import math
import queue
import random

import mlx.core as mx
import numpy as np
import pytest

from tandem.kvtypes import SamplingParams
from tandem.pipeline.api import EngineRequest
from tandem.pipeline.drafters import ModelDrafter, NgramDrafter, lookup
from tandem.pipeline.engine import Engine
from tandem.pipeline.loader import load_model
from tandem.pipeline.runners.cpu.runner import CpuRunner
from tandem.pipeline.settings import EngineSettings
from tandem.pipeline.sequence import Row, Sequence
from tandem.pipeline.speculation import SpecState, Speculator, StepTimes
from tests.pipeline.conftest import EOS, continue_import, oracle, random_prompts
from tests.pipeline.test_engine import CONFIGS, greedy, make

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mixed(tiny):
    prompts = random_prompts(12, 1, 70, seed=17)
    return prompts, [oracle(tiny, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def twin(tiny_model_dir):
    """The tiny model loaded a second time, as its own drafter."""
    from mlx_lm import load

    return load(str(tiny_model_dir))[0]


class MixedDrafter:
    """Right drafts (the model's own greedy continuation) or random tokens, of random
    length, chosen by a seeded coin per proposal."""

    cost = 0.0

    def __init__(self, model, seed: int, vocab: int = 380):
        self.right = ModelDrafter(model, 0.0)
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, seq, k):
        k = self.rng.randint(1, k)
        if self.rng.random() < 0.5:
            return self.right.propose(seq, k)
        return [self.rng.randrange(3, self.vocab) for _ in range(k)]

    def drop(self, serial):
        self.right.drop(serial)


def spec_engine(model, drafter, **kw) -> Engine:
    kw.setdefault("kv_cache_budget", "16MiB")
    # Drafting costing nothing: every row drafts all it may, whatever the batch's width and
    # its acceptance (the measured policy spares wide batches and unlucky rows)
    return Engine(model, EngineSettings(**kw), model_id="tiny", eos_token_ids=[EOS],
                  speculator=Speculator(drafter, times=StepTimes(0.0, measured=False)))


def free_after(eng: Engine) -> None:
    eng.pool.check()
    assert all(c == 0 for c in eng.pool.ref_count)


@pytest.mark.parametrize("name", ["default", "chunked", "small-blocks-small-batch", "no-prefix-cache", "no-decode-mirror"])
def test_self_drafted_batch_matches_single(tiny, twin, mixed, name):
    prompts, expected = mixed
    eng = spec_engine(tiny, ModelDrafter(twin, 0.0), **CONFIGS[name])
    got = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts])
    assert got == expected
    st = eng.stats()
    assert st.spec_draft_tokens > 100 and st.spec_accepted_tokens == st.spec_draft_tokens
    free_after(eng)


@pytest.mark.parametrize("drafter", ["ngram", "mixed"])
def test_rejected_drafts_change_nothing(tiny, twin, mixed, drafter):
    prompts, expected = mixed
    d = NgramDrafter(1, 3) if drafter == "ngram" else MixedDrafter(twin, seed=3)
    eng = spec_engine(tiny, d, block_size=4)
    got = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts])
    assert got == expected
    st = eng.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    free_after(eng)


def test_random_drafts_under_preemption_leak_nothing(tiny, twin, mixed):
    prompts, expected = mixed
    for seed in range(3):
        eng = spec_engine(tiny, MixedDrafter(twin, seed=seed), kv_cache_budget="192KiB", block_size=8)
        got = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts])
        assert got == expected
        assert eng.scheduler.preemptions > 0
        assert 0 < eng.stats().spec_accepted_tokens < eng.stats().spec_draft_tokens
        free_after(eng)


def test_prefix_cache_registers_only_accepted_tokens(tiny, twin):
    """Every registered block holds the tokens its sequence really has (random drafts,
    blocks of 4, so most drafts straddle a block boundary)."""
    prompts = random_prompts(6, 10, 40, seed=5)
    eng = spec_engine(tiny, MixedDrafter(twin, seed=9), block_size=4)
    outs = eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts])
    texts = [tuple(p + o) for p, o in zip(prompts, outs)]
    for b, toks in enumerate(eng.pool.block_tokens):
        if toks is not None:
            assert any(toks in {t[i : i + 4] for i in range(0, len(t) - 3, 4)} for t in texts), b
    # and a second engine run over the cached prefixes still gives the same tokens
    assert eng.generate_many([(p, greedy(MAX_TOKENS)) for p in prompts]) == outs
    free_after(eng)


def test_export_import_with_speculation_continues_identically(tiny, twin):
    prompt = random_prompts(1, 37, 37, seed=11)[0]
    expected = oracle(tiny, prompt, MAX_TOKENS)
    src = spec_engine(tiny, ModelDrafter(twin, 0.0))
    events: queue.Queue = queue.Queue()
    src.start()
    try:
        src.submit(EngineRequest(b"x" * 16, prompt, greedy(MAX_TOKENS), events.put, export_after_prefill=True))
        first, ev = events.get(timeout=30), events.get(timeout=30)
    finally:
        src.stop()
    snap = ev.snapshot
    assert snap is not None and snap.num_computed == len(prompt)
    free_after(src)
    dst = spec_engine(tiny, MixedDrafter(twin, seed=1), block_size=8)
    toks, _ = continue_import(dst, snap)
    assert first.tokens + toks == expected
    assert dst.stats().spec_draft_tokens > 0
    free_after(dst)


def test_sampled_output_equals_unspeculated_for_the_same_seed(tiny, twin, mixed):
    prompts, _ = mixed
    reqs = [(p, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=40 + i,
                               logprobs=2 if i % 3 == 0 else None, frequency_penalty=0.5 if i % 4 == 1 else 0.0))
            for i, p in enumerate(prompts)]
    want = make(tiny).generate_many(reqs)
    eng = spec_engine(tiny, MixedDrafter(twin, seed=4))
    assert eng.generate_many(reqs) == want
    assert eng.stats().spec_accepted_tokens > 0
    free_after(eng)


def test_native_verification_on_4bit_weights_matches_plain_decode(tiny_quantized_model_dir, monkeypatch):
    """The CPU's C step verifying every drafted position at once gives the tokens its
    one-position steps give (greedy and sampled)."""
    model = load_model(str(tiny_quantized_model_dir)).model
    twin = load_model(str(tiny_quantized_model_dir)).model
    calls = []
    real = CpuRunner._verify_native
    monkeypatch.setattr(CpuRunner, "_verify_native", lambda self, rows, inputs: calls.append(len(rows)) or real(self, rows, inputs))
    prompts = random_prompts(6, 5, 60, seed=21)
    for temp in (0.0, 0.8):
        reqs = [(p, SamplingParams(temperature=temp, max_tokens=MAX_TOKENS, seed=i)) for i, p in enumerate(prompts)]
        want = Engine(model, EngineSettings(kv_cache_budget="16MiB"), model_id="q", eos_token_ids=[EOS]).generate_many(reqs)
        eng = Engine(model, EngineSettings(kv_cache_budget="16MiB"), model_id="q", eos_token_ids=[EOS],
                     speculator=Speculator(MixedDrafter(twin, seed=2), times=StepTimes(0.0, measured=False)))
        assert eng.generate_many(reqs) == want
        free_after(eng)
    assert calls and max(calls) > 1  # verified natively, several rows at once


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's upper 0.1% point (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_drafted_token_follows_the_target_distribution(tiny, twin):
    """The second token of a sampled request, which the self-drafter drafts (its greedy
    guess, accepted only when the target's draw agrees), against the target's exact
    marginal for it: sum over first tokens t of p(t | prompt) p(y | prompt, t)."""
    prompt = random_prompts(1, 12, 12, seed=31)[0]
    temp, n = 1.5, 1500
    logits = tiny(mx.array([prompt]))[0, -1].astype(mx.float32)
    p1 = np.array(mx.softmax(logits / temp))
    V = p1.shape[0]
    nxt = tiny(mx.array([prompt + [t] for t in range(V)]))[:, -1].astype(mx.float32)
    p2 = np.array(mx.softmax(nxt / temp, axis=-1))
    marginal = p1 @ p2
    eng = spec_engine(tiny, ModelDrafter(twin, 0.0))
    reqs = [(prompt, SamplingParams(temperature=temp, max_tokens=3, seed=1000 + i, ignore_eos=True)) for i in range(n)]
    outs = eng.generate_many(reqs)
    st = eng.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens  # both verdicts happened
    counts = np.bincount([o[1] for o in outs], minlength=V).astype(np.float64)
    expected = marginal * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < _chi2_critical(len(obs) - 1), (stat, len(obs))
    free_after(eng)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert lookup(toks, 3, 2, 4) == [2, 3, 5]  # the later "5 6 7" wins
    assert lookup(toks, 10, 2, 4)[:2] == [2, 3]
    assert lookup([1, 2, 3, 4], 3, 2, 3) == []
    assert lookup([4, 4, 4, 4], 2, 1, 2) == [4]  # overlapping: up to the sequence's end


def _rows(spec: Speculator, rates: list[float]) -> list[Row]:
    rows = []
    for rate in rates:
        seq = Sequence(b"r" * 16, [5, 6, 7], 3, SamplingParams(max_tokens=100), lambda e: None)
        spec._state[seq.serial] = SpecState(rate=rate)
        rows.append(Row(seq, 2, 1, True))
    return rows


def test_draft_lengths_follow_acceptance_and_the_batch_width():
    spec = Speculator(NgramDrafter(), max_draft=4, retry_steps=4, times=StepTimes(0.1, measured=False))
    assert spec.lengths(_rows(spec, [0.95])) == [4]
    assert 1 <= spec.lengths(_rows(spec, [0.5]))[0] <= 2
    assert spec.lengths(_rows(spec, [0.05])) == [0]
    # a wide batch: nothing at 50% acceptance, a few tokens for its surest rows only
    assert sum(spec.lengths(_rows(spec, [0.5] * 16))) == 0
    ks = spec.lengths(_rows(spec, [0.95] * 4 + [0.3] * 12))
    assert all(k > 0 for k in ks[:4]) and not any(ks[4:])
    # a row that stopped drafting gets one token again after retry_steps idle steps (alone)
    rows = _rows(spec, [0.02])
    got = [spec.lengths(rows)[0] for _ in range(5)]
    assert got == [0, 0, 0, 0, 1]
    # an expensive drafter needs a higher acceptance to be worth running
    costly = Speculator(ModelDrafter(None, 0.6), times=StepTimes(0.1, measured=False))
    assert costly.lengths(_rows(costly, [0.5])) == [0] and costly.lengths(_rows(costly, [0.9])) != [0]


def test_a_retry_that_a_wide_batch_does_not_take_leaves_the_rows_rates():
    """Rows that stopped drafting are offered one token every retry_steps steps; in a wide
    batch that does not take it, their rates stay what verification measured, so the batch
    never drafts on the retry's optimism (16 rows that started together, raised at once,
    declined it, then drafted 4 tokens each at the next step and accepted half)."""
    spec = Speculator(NgramDrafter(), max_draft=4, retry_steps=4)
    for p_, t in [(1, 6.5), (2, 10.0), (5, 12.0), (8, 15.0), (16, 24.0), (17, 26.5), (24, 30.0), (32, 46.0)] * 3:
        spec.times.observe(p_, t * 1e-3)
    rows = _rows(spec, [0.1] * 16)
    for r, k in zip(rows, range(16)):  # they stopped drafting at different steps
        spec._state[r.seq.serial].idle = k % 5
    assert all(sum(spec.lengths(rows)) == 0 for _ in range(20))
    assert all(spec._state[r.seq.serial].rate == 0.1 for r in rows)
    lone = _rows(spec, [0.1])  # alone, the retry pays: one token, and the raised rate is kept
    got = [spec.lengths(lone)[0] for _ in range(5)]
    assert got == [0, 0, 0, 0, 1] and spec._state[lone[0].seq.serial].rate > 0.1


def test_step_times_are_measured_per_size_and_filled_in_between():
    times = StepTimes(0.1)
    assert times.at(5) == pytest.approx(1.4)  # nothing measured: the prior, in one-row steps
    times.observe(1, 0.0065)
    assert times.at(3) == pytest.approx(0.0065 * 1.2)  # one size: the prior's slope past it
    for _ in range(3):
        for p_, t in [(1, 0.0065), (2, 0.011), (16, 0.024), (17, 0.0265), (24, 0.028)]:
            times.observe(p_, t)
    assert times.at(16) == 0.024 and times.at(20) == pytest.approx(0.0265 + 1.5e-3 * 3 / 7)
    assert times.at(32) == pytest.approx(0.028 + (0.028 - 0.0065) / 23 * 8)  # the mean slope of those measured
    assert times.at(8) == pytest.approx(0.011 + 0.013 * 6 / 14)
    times.observe(16, 0.034)
    times.observe(16, 0.035)
    assert times.at(16) == pytest.approx(0.024)  # the median of the recent steps: 3 of 5 still 24 ms
    # verifying steps: a plain step's cost until measured; then their own, and elsewhere a
    # plain step's plus what verifying added at the nearest size measured
    assert times.at(18, verifying=True) == times.at(18)
    times.observe(18, 0.090, verifying=True)  # seen once: no dearer than a plain step
    assert times.at(18, verifying=True) == times.at(18)
    for _ in range(2):
        times.observe(18, 0.060, verifying=True)
    assert times.at(18, verifying=True) == pytest.approx(0.060)
    extra = 0.060 - times.at(18)
    assert times.at(24, verifying=True) == pytest.approx(0.028 + extra)
    assert times.at(2, verifying=True) == pytest.approx(0.011 + extra)
    times.forget()
    assert times.at(16) == pytest.approx(2.5) and not times.plain_known
    fixed = StepTimes(0.1, measured=False)
    fixed.observe(5, 1.0)
    assert fixed.at(5) == pytest.approx(1.4) and fixed.plain_known


def test_wide_batches_draft_where_the_measured_steps_pay():
    """A CPU-like table: one position cheap, positions 8 to a tile. A lone sequence drafts
    at 60% acceptance; 16 rows do not at 70%: the 17th position opens a tile; at 95% they
    fill the next tile, never a lone token past the boundary."""
    spec = Speculator(NgramDrafter())
    for p_, t in [(1, 6.5), (2, 10.0), (5, 12.0), (8, 15.0), (16, 24.0), (17, 26.5), (24, 30.0), (32, 46.0)] * 3:
        spec.times.observe(p_, t * 1e-3)  # plain steps; verifying ones cost as much until measured
    assert spec.lengths(_rows(spec, [0.6]))[0] >= 2
    assert spec.lengths(_rows(spec, [0.15])) == [0]
    assert sum(spec.lengths(_rows(spec, [0.7] * 16))) == 0
    assert sum(spec.lengths(_rows(spec, [0.95] * 16))) == 8
    # verification dearer than a step (a prefill path): a lone one does not draft, a retry neither
    dear = Speculator(NgramDrafter(), retry_steps=1)
    dear.times.observe(1, 2.5e-3)
    for p_, t in [(2, 12.0), (5, 13.0)] * 3:
        dear.times.observe(p_, t * 1e-3, verifying=True)
    rows = _rows(dear, [0.9])
    assert [dear.lengths(rows)[0] for _ in range(4)] == [0, 0, 0, 0]


class RecordedDrafter:
    """Proposes the target's recorded greedy continuation (every draft accepted), for free."""

    cost = 0.0

    def __init__(self, prompts, outputs):
        self.by_prompt = {tuple(p): o for p, o in zip(prompts, outputs)}

    def propose(self, seq, k):
        done = len(seq.tokens) - seq.prompt_len
        return self.by_prompt[tuple(seq.tokens[: seq.prompt_len])][done: done + k]

    def drop(self, serial):
        pass


def test_a_sequence_whose_drafting_is_slower_stops_drafting(tiny):
    """End to end on the engine: with every verifying step held 30 ms (a runner whose
    verification is dear), sequences alone whose drafts are all accepted measure it and
    stop drafting after their first tries; the output is unchanged."""
    import time as _time

    prompts = random_prompts(4, 10, 30, seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = make(tiny).generate_many([(p, sp) for p in prompts])
    spec = Speculator(RecordedDrafter(prompts, want))
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS], speculator=spec)
    real, verifying = eng.runner.forward, []

    def forward(rows, inputs):
        if any(r.draft for r in rows):
            verifying.append(sum(r.n for r in rows))
            _time.sleep(0.03)
        return real(rows, inputs)

    eng.runner.forward = forward
    assert eng.generate_many([(prompts[0], sp)]) == want[:1]
    # tried until a size was seen three times (one slow step must not price a size out)
    assert 3 <= len(verifying) <= 8, verifying
    assert spec.times.at(3, verifying=True) > spec.times.at(3) + 0.02
    tried = len(verifying)
    assert [eng.generate_many([(p, sp)])[0] for p in prompts[1:]] == want[1:]
    assert len(verifying) - tried <= 4, verifying  # known dear now: a retry now and then at most
    free_after(eng)


def test_a_drafter_that_raises_costs_its_steps_their_drafts_only(tiny):
    class Broken(NgramDrafter):
        def propose(self, seq, k):
            raise RuntimeError("a drafter bug")

    prompts = random_prompts(3, 10, 30, seed=9)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS],
                 speculator=Speculator(Broken(), times=StepTimes(0.0, measured=False)))
    assert eng.generate_many([(p, sp) for p in prompts]) == make(tiny).generate_many([(p, sp) for p in prompts])
    assert eng.stats().spec_draft_tokens == 0
    free_after(eng)


def test_speculative_settings_build_the_drafter_they_name(tiny, tiny_model_dir):
    from tandem.pipeline.settings import SpeculativeSettings
    from tandem.pipeline.speculation import make_speculator

    assert make_speculator(SpeculativeSettings(mode="off"), tiny) is None
    # auto: prompt lookup on the CPU (these tests' device), off on a GPU
    assert isinstance(make_speculator(SpeculativeSettings(), tiny, log=lambda m: None).drafter, NgramDrafter)
    assert SpeculativeSettings().resolved(on_cpu=False) == "off" and SpeculativeSettings().resolved(on_cpu=True) == "ngram"
    assert SpeculativeSettings(mode="ngram").resolved(on_cpu=False) == "ngram"
    spec = make_speculator(SpeculativeSettings(mode="ngram", ngram_min=1, ngram_max=3, max_draft=6), tiny, log=lambda m: None)
    assert isinstance(spec.drafter, NgramDrafter) and (spec.drafter.min_n, spec.max_draft) == (1, 6)
    spec = make_speculator(SpeculativeSettings(mode=f"draft:{tiny_model_dir}"), tiny, log=lambda m: None)
    assert isinstance(spec.drafter, ModelDrafter) and spec.drafter.cost == pytest.approx(1.0, rel=0.05)
    for bad in ("draft:", "draft", "medusa", "ngram:3"):
        with pytest.raises(ValueError, match="off, ngram or draft:PATH"):
            make_speculator(SpeculativeSettings(mode=bad), tiny)
    with pytest.raises(ValueError, match="ngram_min"):
        make_speculator(SpeculativeSettings(mode="ngram", ngram_min=4, ngram_max=2), tiny)

    def other_vocab(x):  # a target whose vocabulary the draft model does not share
        return mx.zeros((1, 1, 7))

    with pytest.raises(ValueError, match="tokenizer"):
        make_speculator(SpeculativeSettings(mode=f"draft:{tiny_model_dir}"), other_vocab, log=lambda m: None)


class WrongDrafter(MixedDrafter):
    """Always wrong: the model's own greedy continuation, each token shifted by one."""

    def propose(self, seq, k):
        return [(t + 1) % self.vocab for t in self.right.propose(seq, k)]


def test_a_drafter_that_is_always_wrong_is_backed_off(tiny, twin):
    """Alone, a position priced at 0.1 of a step: after a few rejected drafts a sequence drafts only a
    probe token now and then, and its output is unchanged."""
    prompt = random_prompts(1, 20, 20, seed=8)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    want = make(tiny).generate_many([(prompt, sp)])
    eng = Engine(tiny, EngineSettings(kv_cache_budget="16MiB"), model_id="tiny", eos_token_ids=[EOS],
                 speculator=Speculator(WrongDrafter(twin, seed=0, vocab=twin.args.vocab_size),
                                       times=StepTimes(0.1, measured=False)))  # (timings: not on a loaded CI)
    assert eng.generate_many([(prompt, sp)]) == want
    st = eng.stats()
    assert st.spec_accepted_tokens == 0 and 0 < st.spec_draft_tokens < 40, st  # of 200 tokens
    free_after(eng)
