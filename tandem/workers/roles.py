"""What a worker's role changes in its engine's settings, before the engine is built.

The engine's defaults are a hybrid worker's: it both prefills and decodes. A worker with
one role builds its engine with that role's settings; nothing reaches into the engine
once it exists (the engine owns its scheduler, pool and store):

* **prefill**: no one-row decode graphs (``engine.decode_graphs``: it exports each
  sequence after its first token and never decodes, and on a GPU their capture costs
  seconds of the start and their buffers); ``worker.prefill_batch`` prompts at most are
  prefilled together (default 0: the engine's ``max_batch_prefill``, as a hybrid worker;
  the engine reads each exporting step back before it starts the next). A prefill
  worker's product is first tokens and handoffs, and a batch holds every first token
  until its last prompt is done; on the CPU four prompts a step gave the best
  throughput and time to first token once a batch's first tokens were emitted at once
  (docs/benchmarks/LOG.md, disaggregated serving).
* **decode**: no prefix cache (``engine.enable_prefix_caching``), a KV store sized for
  its batch from the start (``engine.kv_initial_tokens``), and the KV imports that are
  waiting go into one step (``engine.parallel`` of them, not
  ``engine.max_batch_prefill``): a burst's imports split into steps of four cost a
  forward pass and a rebuild of the decode batch's contiguous KV copy each.

Why a decode worker keeps no prefix cache: imported KV is never looked up in the cache
(an import carries all of its KV), yet its full blocks were registered there when the
request finished. The pool hands out empty blocks before it evicts cached ones, so those
blocks pushed its high-water mark a request's worth up per request, and the KV store grew
by doubling, each time copying the whole store inside a step (stalls of the decode batch
growing with the store, bench/disagg.py timeline). Without the cache, freed blocks go back
empty and lowest-first, so the store stays at the working set, which is the batch: so it
is allocated at that size up front instead of doubling inside the first bursts' steps.
Only a request the decode worker runs from its prompt (a RESUME) loses prefix reuse.
"""

from __future__ import annotations

def engine_settings(settings, role: str, *, prefill_batch: int = 0) -> None:
    """Set ``role``'s policies in the engine's ``settings`` (an ``EngineSettings``), before
    the engine is built from them. ``prefill_batch`` is ``worker.prefill_batch``."""
    import mlx.core as mx

    settings.resolve(on_cpu=mx.default_device() == mx.cpu)  # (the decode role reads parallel)
    if role == "prefill":
        settings.decode_graphs = False
        if prefill_batch:
            settings.max_batch_prefill = prefill_batch
    elif role == "decode":
        settings.enable_prefix_caching = False
        settings.max_batch_prefill = max(settings.max_batch_prefill, settings.parallel)
        bs = settings.block_size
        batch_tokens = settings.parallel * -(-settings.prefill_chunk_size // bs) * bs
        settings.kv_initial_tokens = max(settings.kv_initial_tokens or 0, batch_tokens)
