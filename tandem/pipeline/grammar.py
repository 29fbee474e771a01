"""Grammar-constrained decoding: one llguidance matcher per constrained sequence.

llguidance (over xgrammar and outlines-core) because it needs no ahead-of-time
compilation per schema (a JSON schema or a Lark grammar starts in milliseconds, where
outlines-core builds a whole-vocabulary index per regex), computes a mask in tens of
microseconds with the GIL released, has no torch dependency (xgrammar pulls in torch
and transformers' model stack), and its matcher can be rebuilt anywhere by replaying
the tokens: what a KV handoff or a migration needs.

:class:`Grammars` owns the matchers. The engine thread feeds them each read-back token
(:meth:`advance`); the masks for a step are computed on this module's thread while the
step's forward runs (:meth:`start_masks` returns a future the sampler waits on), so a
batch with a constrained row pays for its mask only where it outlasts the forward.
A grammar (or a penalty) needs each step's token on the host before the next step's
mask, so a step holding such a row is read back before the next one is launched: on the
CPU every step already is; on a GPU it gives up the one-step-deep pipelining for that
batch while such a row is in it.
A matcher is created the first time its sequence needs a mask, by replaying the
tokens that sequence already generated: a sequence imported from a prefill worker or
resumed after a migration continues the grammar exactly where it was.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tandem.pipeline.sequence import Sequence

log = logging.getLogger("tandem.grammar")


def build_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids):
    """llguidance's view of a fast HF tokenizer, sized to the model's logits."""
    import llguidance.hf

    eos = sorted(int(t) for t in eos_token_ids) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


class GrammarError(ValueError):
    """A grammar the matcher cannot run (bad schema, bad Lark, too complex)."""


def check_grammar(grammar: str, tokenizer) -> None:
    """Raise :class:`GrammarError` saying why, unless ``grammar`` compiles for ``tokenizer``."""
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except Exception as exc:  # malformed JSON text and the like
        raise GrammarError(f"invalid grammar: {exc}") from None
    if is_error:
        raise GrammarError(f"invalid grammar: {messages[0] if messages else 'unknown error'}")


class Grammars:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        # Building the token trie takes ~1 s for a 50k vocabulary: off the start-up path.
        self._tokenizer: Future = self._pool.submit(build_tokenizer, hf_tokenizer, vocab_size, eos_token_ids)
        self._matchers: dict[int, object] = {}  # Sequence.serial -> LLMatcher
        self.errors: dict[int, str] = {}  # Sequence.serial -> why its grammar failed

    @property
    def tokenizer(self):
        return self._tokenizer.result()

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` unless ``grammar`` compiles (any thread)."""
        check_grammar(grammar, self.tokenizer)

    # ---- engine thread ----------------------------------------------------------
    def start_masks(self, seqs: list[Sequence]) -> Future | None:
        """The bitmask (len(seqs), words) int32 of the next token of each sequence
        (all bits set for those without a grammar), computed on the grammar thread."""
        if not any(s.sampling.grammar is not None for s in seqs):
            return None
        return self._pool.submit(self._fill, list(seqs))

    def advance(self, seq: Sequence, token: int) -> str | None:
        """Feed a read-back token; the reason when the grammar refused it (else None)."""
        m = self._matchers.get(seq.serial)
        if m is None:  # not started yet: it replays the tokens when it is
            return self.errors.get(seq.serial)
        if not m.consume_token(token):
            why = m.get_error() or f"token {token} is outside the grammar"
            self.errors[seq.serial] = why
            return why
        return None

    def drop(self, seq: Sequence) -> None:
        self._matchers.pop(seq.serial, None)
        self.errors.pop(seq.serial, None)

    # ---- grammar thread ---------------------------------------------------------
    def _fill(self, seqs: list[Sequence]) -> np.ndarray:
        import llguidance.numpy as lnp

        mask = np.full((len(seqs), self.words), -1, np.int32)
        for i, seq in enumerate(seqs):
            if seq.sampling.grammar is None or seq.serial in self.errors:
                continue
            m = self._matchers.get(seq.serial) or self._start(seq)
            if m is None:
                continue
            if m.is_stopped():  # the grammar is complete: only an end token may follow
                words = mask.view(np.uint32)
                words[i] = 0
                for t in self.tokenizer.eos_tokens:
                    words[i, t // 32] |= np.uint32(1 << (t % 32))
                continue
            lnp.fill_next_token_bitmask(m, mask, i)
            if m.is_error():
                self.errors[seq.serial] = m.get_error()
        return mask

    def _start(self, seq: Sequence):
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, seq.sampling.grammar)
        if not m.is_error():
            done = seq.tokens[seq.output_start:]
            if done and not m.consume_tokens(done):
                self.errors[seq.serial] = f"the tokens generated so far do not follow the grammar: {m.get_error()}"
                return None
        if m.is_error():
            self.errors[seq.serial] = m.get_error()
            return None
        self._matchers[seq.serial] = m
        return m

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
