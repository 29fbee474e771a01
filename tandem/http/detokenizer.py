"""Incremental detokenization: text deltas whose concatenation equals decoding all tokens at once.

Two strategies behind one interface:

* byte-level BPE (GPT-2 style, SmolLM2, Llama 3, Qwen): each token is a fixed byte
  string, so the text is ``b"".join(bytes).decode("utf-8", "replace")``. Python's
  incremental UTF-8 decoder holds back an unfinished character and produces exactly
  the one-shot result, so streaming is exact by construction and O(1) per token.
* anything else (SentencePiece, tokenizers with space clean-up): re-decode a short
  window of recent tokens and emit the growth, holding back while the window ends
  in U+FFFD (an unfinished character); ``finish()`` reconciles against one full
  decode so the total is still exact.
"""

from __future__ import annotations

import codecs

from tandem.http.tokenizer import EdgeTokenizer

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: EdgeTokenizer):
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._emitted: list[str] = []
        if tokenizer.token_bytes is not None:
            self._bytes = tokenizer.token_bytes
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._bytes = None
            self._prefix = 0  # window start
            self._read = 0  # tokens whose text has been emitted

    def add(self, tokens: list[int]) -> str:
        """Feed new tokens; return the text that is now final."""
        self.tokens.extend(tokens)
        if self._bytes is not None:
            out = self._utf8.decode(b"".join(self._token_bytes(t) for t in tokens))
        else:
            out = self._window_delta()
        if out:
            self._emitted.append(out)
        return out

    def finish(self) -> str:
        """Flush what was held back; afterwards the emitted text equals ``decode(tokens)``."""
        if self._bytes is not None:
            out = self._utf8.decode(b"", final=True)
        else:
            full = self._tok.decode(self.tokens)
            emitted = "".join(self._emitted)
            # The window can only disagree with a full decode when a tokenizer rewrites
            # text across the window start; what was sent cannot be recalled then.
            out = full[len(emitted):] if full.startswith(emitted) else ""
        if out:
            self._emitted.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(self._emitted)

    def _token_bytes(self, token: int) -> bytes:
        if 0 <= token < len(self._bytes):
            b = self._bytes[token]
            if b is not None:
                return b
        # Ids outside the vocabulary decode to nothing, as the tokenizer does.
        return b""

    def _window_delta(self) -> str:
        prefix_text = self._tok.decode(self.tokens[self._prefix:self._read])
        new_text = self._tok.decode(self.tokens[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        # The emitted tokens become the next window's context, so leading-space
        # rules of the next piece see the piece before it.
        self._prefix = self._read
        self._read = len(self.tokens)
        return delta
