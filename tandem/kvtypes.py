"""Types shared by the engine (which produces and consumes them) and the wire (which moves them).

Plain numpy and Python values only: importing this module never imports mlx, so the
broker and the wire codec stay model-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

REQUEST_ID_BYTES = 16


@dataclass
class SamplingParams:
    """How to pick each token. Seeded sampling derives step ``i``'s key from
    ``(seed, i)``, so the RNG state that travels with a request is just the seed and
    the number of tokens generated so far."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None = no logprobs; N >= 0 = chosen token's logprob plus top N
    ignore_eos: bool = False
    # Where this request's first token sits in its seeded stream: a request migrated after
    # k streamed tokens resubmits prompt + those tokens with seed_offset k, and draws
    # exactly what the worker that died would have drawn next.
    seed_offset: int = 0
    # OpenAI's penalties on the tokens generated so far: logit -= frequency_penalty * count
    # + presence_penalty * (count > 0). repetition_penalty (llama.cpp / vLLM) divides a
    # positive logit, multiplies a negative one, of every token already in prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # An llguidance grammar (its JSON text) every generated token must follow, or None.
    grammar: str | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the logits or the history: one argmax decides."""
        return (self.temperature <= 0 and self.logprobs is None and not self.logit_bias
                and not self.penalized and self.grammar is None)

    @property
    def needs_history(self) -> bool:
        """Whether picking the next token needs the tokens before it on the host
        (penalties count them, a grammar consumes them)."""
        return self.penalized or self.grammar is not None


@dataclass
class Usage:
    """A finished request's token counts (what the OpenAI ``usage`` object reports)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass
class TokenLogprob:
    """One chosen token's log-probability and, when asked for, the top alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class KVSnapshot:
    """One sequence's KV cache and sampling state at a step boundary.

    ``tokens`` is the prompt followed by every token generated so far. The KV of the
    first ``num_computed`` tokens is in the blocks; the remaining token(s) (normally
    exactly one: the last sampled token) have not been fed to the model yet, so the
    importer continues by feeding ``tokens[num_computed:]``.

    ``keys[layer]`` and ``values[layer]`` have shape
    ``(num_blocks, num_kv_heads, block_size, head_dim)`` where
    ``num_blocks = ceil(num_computed / block_size)``; slots past ``num_computed`` in the
    last block are undefined. ``dtype`` names the element type; ``bfloat16`` arrays
    travel as ``uint16`` views because numpy has no bfloat16.

    A KV export streamed while its prompt is prefilled comes in parts: each holds only
    blocks ``[first_block, first_block + len(keys[0]))`` (the blocks before went out in
    earlier parts) and already has the final geometry (``num_computed`` = the whole
    prompt); the last part carries the sampled token. A snapshot an engine imports is
    always whole (``first_block`` 0).
    """

    request_id: bytes
    model_id: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens: list[int]
    num_computed: int
    prompt_len: int
    keys: list[np.ndarray]
    values: list[np.ndarray]
    sampling: SamplingParams
    num_generated: int = 0
    num_cached_prompt_tokens: int = 0
    first_block: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)
