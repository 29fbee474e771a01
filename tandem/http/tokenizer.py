"""The model's tokenizer and chat template, without its weights.

The edge is model-free: it reads ``tokenizer.json``/``tokenizer_config.json`` and
``config.json`` from the model directory and never allocates weight memory.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.edge")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100+.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class EdgeTokenizer:
    """Encode prompts, render chat templates, and expose per-token bytes for streaming."""

    hf: object  # a transformers tokenizer
    eos_token_ids: frozenset[int]
    context_length: int | None
    # token id -> raw bytes, when the tokenizer is byte-level BPE (exact incremental decoding)
    token_bytes: list[bytes | None] | None
    special_ids: frozenset[int]
    # The model family's tool-call markers and parser (from mlx-lm), or None: Hermes JSON.
    call_format: object = None

    # verbose=False: an over-long prompt is the edge's to refuse (context_length_exceeded);
    # transformers' own "sequence length is longer than" warning would only add noise.
    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True, verbose=False))

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (and tool calls and results) itself."""
        template = getattr(self.hf, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    def render_chat(self, messages: list[dict], tools=None) -> str:
        """The prompt text of a conversation; ``tools``: a :class:`tandem.http.tools.Tools` or None."""
        from tandem.http.tools import template_messages

        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        messages, tool_arg = template_messages(messages, tools, self.template_takes_tools)
        kw = {"tools": tool_arg} if tool_arg else {}
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)

    def encode_chat(self, text: str) -> list[int]:
        """A rendered conversation's tokens: the template already carries any BOS, so
        encoding must not add a second one."""
        return list(self.hf.encode(text, add_special_tokens=False, verbose=False))

    def apply_chat_template(self, messages: list[dict], tools=None) -> list[int]:
        return self.encode_chat(self.render_chat(messages, tools))

    def decode(self, tokens: list[int]) -> str:
        return self.hf.decode(tokens, skip_special_tokens=True)

    def warm(self) -> None:
        """Render and encode a one-message chat once: the first render compiles the chat
        template (~30 ms here, 50x a later one), which the first request would otherwise pay
        in its time to first token. The edge loads its tokenizer in gunicorn's master, so
        every forked worker inherits the compiled template."""
        try:
            self.apply_chat_template([{"role": "user", "content": "Hello"}])
        except Exception as exc:  # a template that refuses this conversation refuses it per request too
            log.debug("chat template warm-up: %s", exc)
        self.encode("Hello")

    def token_text(self, token: int) -> str:
        return self.hf.decode([token], skip_special_tokens=False)

    def raw_bytes(self, token: int) -> bytes:
        if self.token_bytes is not None and 0 <= token < len(self.token_bytes) and self.token_bytes[token] is not None:
            return self.token_bytes[token]
        return self.token_text(token).encode("utf-8")

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def _byte_level_table(hf) -> tuple[list[bytes | None] | None, frozenset[int]]:
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None, frozenset(getattr(hf, "all_special_ids", []))
    spec = json.loads(backend.to_str())
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    special = frozenset(i for i, a in added.items() if a.get("special"))
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel" or getattr(hf, "clean_up_tokenization_spaces", False):
        return None, special
    u2b = _unicode_to_byte()
    vocab = backend.get_vocab(with_added_tokens=True)
    table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for piece, idx in vocab.items():
        if idx in added:
            table[idx] = b"" if idx in special else added[idx]["content"].encode("utf-8")
            continue
        try:
            table[idx] = bytes(u2b[ch] for ch in piece)
        except KeyError:
            return None, special  # not a pure byte-level vocabulary after all
    return table, special


def load_tokenizer(model_path: str | Path) -> EdgeTokenizer:
    """Load only the tokenizer files of an mlx-lm model directory."""
    from mlx_lm.tokenizer_utils import load as load_wrapper

    path = Path(model_path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    config = json.loads(config_file.read_text())
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    wrapper = load_wrapper(path, eos_token_ids=eos_ids or None)
    hf = wrapper._tokenizer
    table, special = _byte_level_table(hf)
    context = config.get("max_position_embeddings") or getattr(hf, "model_max_length", None)
    if context is not None and context > 10**7:  # transformers' "no limit" sentinel
        context = None
    call_format = None
    if getattr(wrapper, "has_tool_calling", False) and wrapper.tool_call_start and wrapper.tool_call_end:
        from tandem.http.tools import CallFormat

        call_format = CallFormat(wrapper.tool_call_start, wrapper.tool_call_end, wrapper.tool_parser)
    tok = EdgeTokenizer(
        call_format=call_format,
        hf=hf,
        eos_token_ids=frozenset(wrapper.eos_token_ids),
        context_length=context,
        token_bytes=table,
        special_ids=special,
    )
    tok.warm()
    return tok
