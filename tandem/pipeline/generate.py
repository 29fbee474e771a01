"""The single-request path: one prompt, one sequence, mlx-lm's own generation loop.

This is the oracle the batched engine is checked against, so it deliberately adds
nothing of its own to the computation: it renders the chat template, hands the
prompt to ``mlx_lm.stream_generate`` with a sampler, and streams text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import tandem  # noqa: F401
import mlx.core as mx

from tandem.pipeline.loader import LoadedModel


@dataclass
class Piece:
    text: str
    token: int
    finish_reason: str | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float


def chat_prompt(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as one user turn under the model's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def stream(
    loaded: LoadedModel,
    prompt_tokens: list[int],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> Iterator[Piece]:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from tandem.pipeline.loader import dequantize_in_place, packed_only

    if packed_only(loaded.model):  # mlx-lm's forward runs here: dense fp32 is its fast form on the CPU
        dequantize_in_place(loaded.model)

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    for r in stream_generate(loaded.model, loaded.tokenizer, prompt_tokens, max_tokens=max_tokens, sampler=sampler):
        yield Piece(r.text, r.token, r.finish_reason, r.prompt_tokens, r.prompt_tps, r.generation_tokens, r.generation_tps)


def generate_tokens(loaded: LoadedModel, prompt_tokens: list[int], **kwargs) -> list[int]:
    """All generated token ids, including the final EOS token if one ended the sequence."""
    return [p.token for p in stream(loaded, prompt_tokens, **kwargs)]
