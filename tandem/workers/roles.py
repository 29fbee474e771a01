"""What a worker's role changes in its engine's scheduling (before the engine thread starts).

The engine's defaults are a hybrid worker's: it both prefills and decodes. A worker with
one role sets its engine up for that role:

* **prefill**: no one-row decode graphs (``engine.decode_graphs``: it exports each
  sequence after its first token and never decodes, and on a GPU their capture costs
  7-15 s of the start and their buffers); ``worker.prefill_batch`` prompts at most are
  prefilled together (default
  0: the engine's ``max_batch_prefill``, as a hybrid worker; the engine reads each
  exporting step back before it starts the next). A prefill worker's product
  is first tokens and handoffs, and a batch holds every first token until its last
  prompt is done. On this 2-core CPU (bench/disagg.py, 256-token prompts) a step has
  about 70 ms of fixed cost: one prompt per step took 630 ms per prompt against 575 ms
  at four (engine at c2312d3: gated layout 0.87x hybrid). Two per step did best while
  the engine emitted a batch's first tokens only after the next step (0.96x); once it
  emitted them at once (1c5b4be), four per step gave 0.96x and a TTFT p50 403 ms below
  hybrid's, against +206 ms at two (docs/benchmarks/disagg.md).
* **decode**: no prefix cache (:func:`imported_kv_not_cached`), a KV store sized for its
  batch from the start (:func:`size_store_for_batch`), and the KV imports that are
  waiting go into one step (``engine.parallel`` of them, not
  ``engine.max_batch_prefill``): a burst's imports were split into two steps of four,
  each one a forward pass and a rebuild of the decode batch's contiguous KV copy.
"""

from __future__ import annotations


def imported_kv_not_cached(engine) -> bool:
    """A decode worker's engine keeps no prefix cache (False for an engine without one).

    Imported KV is never looked up in the cache (an import carries all of its KV), yet
    its full blocks were registered there when the request finished. The pool hands out
    empty blocks before it evicts cached ones, so those blocks pushed its high-water mark
    a request's worth up per request, and the KV store grew by doubling, each time copying
    the whole store inside a step: 0.6, 0.9 and 1.6 s stalls of the decode batch at 128,
    256 and 512 blocks (bench/disagg.py timeline), on top of the same growth on the prefill
    worker, where the hybrid layout pays it once. Without the cache, freed blocks go back
    empty and lowest-first, so the store stays at the working set. Only a request the
    decode worker runs from its prompt (a RESUME) loses prefix reuse."""
    sched, pool = getattr(engine, "scheduler", None), getattr(engine, "pool", None)
    if sched is None or pool is None or not hasattr(pool, "reset_prefix_cache"):
        return False
    sched.prefix_caching = False
    pool.reset_prefix_cache()
    return True


def engine_settings(settings, role: str) -> None:
    """What ``role`` changes in the engine's settings before the engine is built."""
    if role == "prefill":
        settings.decode_graphs = False


def set_up(engine, role: str, *, prefill_batch: int = 0) -> None:
    """Apply ``role``'s policies to ``engine`` (the stub engine has none to change)."""
    settings = getattr(engine, "settings", None)
    if role == "prefill" and settings is not None and prefill_batch:
        settings.max_batch_prefill = prefill_batch  # the scheduler reads it per step
    if role == "decode":
        imported_kv_not_cached(engine)
        if settings is not None:
            settings.max_batch_prefill = max(settings.max_batch_prefill, settings.parallel)
            size_store_for_batch(engine)


def size_store_for_batch(engine) -> int:
    """Allocate a decode worker's KV store for ``engine.parallel`` sequences of
    ``engine.prefill_chunk_size`` tokens now (at most the pool), instead of doubling it
    inside the first bursts' steps: the store starts at 64 blocks and each doubling copies
    all of it while the batch waits (bench/disagg.py timeline, first loaded burst: the
    import step 0.87 s and a decode step 0.41 s, against 0.23 s and 0.03 s later). With
    no prefix cache (above), the working set is the batch, so the store stays at this
    size unless longer sequences need more. Returns the store's capacity in blocks (0
    without a paged store)."""
    store, pool, s = getattr(engine, "store", None), getattr(engine, "pool", None), getattr(engine, "settings", None)
    if store is None or pool is None or s is None or not hasattr(store, "ensure_capacity"):
        return 0
    store.ensure_capacity(min(pool.num_blocks, s.parallel * pool.blocks_for(s.prefill_chunk_size)))
    pool.addressable = store.capacity
    return store.capacity
