"""One mlx-lm cache per sequence, one forward per row: for models whose layers want
anything but a plain ``KVCache`` (sliding windows, recurrent state), which the paged store
cannot hold. No prefix caching, no KV export."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from tandem.pipeline.runner import RunnerBase
from tandem.pipeline.sequence import Row


class DenseRunner(RunnerBase):
    def __init__(self, model):
        self.model = model

    def forward(self, rows: list[Row], inputs: mx.array) -> mx.array:
        out = []
        for i, r in enumerate(rows):
            if r.seq.dense_cache is None or r.start == 0:
                r.seq.dense_cache = make_prompt_cache(self.model)
            logits = self.model(inputs[i : i + 1, : r.n], cache=r.seq.dense_cache)
            out.append(logits[:, -1, :])
        return mx.concatenate(out, axis=0)
