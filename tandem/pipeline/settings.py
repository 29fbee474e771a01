"""Settings owned by the engine (section [engine]) and model loading (section [model])."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelSettings:
    path: str | None = field(default=None, metadata={"help": "mlx-lm model directory; default: the bundled SmolLM2-135M-Instruct, fetched on first use"})
    weights: str = field(default="auto", metadata={"choices": ("auto", "dense", "quantized"), "help": "run quantized weights as they are, or dequantize them (dense is faster on the CPU BLAS path); auto picks per backend"})


CPU_PARALLEL = 16  # engine.parallel where unset, on the CPU (docs/engine.md)
GPU_PARALLEL = 128  # and on a GPU


@dataclass
class EngineSettings:
    parallel: int | None = field(default=None, metadata={"min": 1, "max": 4096, "help": "maximum active (admitted) sequences; unset = 16 on the CPU, 128 on a GPU (a GPU's decode step costs little more at 128 rows than at 16: at 16 a served 8B model got 2,117 tok/s on an H100, at 128 6,640)"})
    max_batch_size: int = field(default=0, metadata={"min": 0, "help": "sequences decoded together in one step; 0 = parallel"})
    max_batch_prefill: int = field(default=4, metadata={"min": 1, "help": "prompts batched into one prefill pass"})
    admit_wait_ms: float | None = field(default=None, metadata={"min": 0, "help": "an idle engine that receives a request waits up to this long for max_batch_prefill of them before its first prefill (a burst's prompts arrive a few ms apart; one prefilled alone costs more per prompt); 0 = start at once; unset = 5 on the CPU, 0 on a GPU (where a prompt's whole prefill takes ~15 ms)"})
    max_batch_prefill_tokens: int | None = field(default=None, metadata={"min": 0, "help": "padded-token cap on one batched prefill; unset = 2 x max_batch_prefill x prefill_chunk_size, 0 = uncapped"})
    max_queue_depth: int = field(default=64, metadata={"min": 0, "help": "queued (not yet admitted) requests beyond which a submit is refused"})
    prefill_chunk_size: int = field(default=512, metadata={"min": 16, "help": "tokens per prefill chunk"})
    prefill_grant_interval: int = field(default=16, metadata={"min": 0, "help": "decode ticks a parked chunked prefill waits before it is granted one; 0 disables"})
    enable_preemption: bool = field(default=True, metadata={"help": "recompute the lowest-priority sequence under KV pressure"})
    block_size: int = field(default=16, metadata={"min": 1, "max": 1024, "help": "tokens per KV block"})
    kv_cache_budget: str = field(default="auto", metadata={"help": "KV pool size: auto (on a GPU: this worker's share of device memory less what its weights and buffers hold; on the CPU: half the free memory over workers_per_device), none (unbounded), or a size such as 2GiB"})
    workers_per_device: int = field(default=1, metadata={"min": 1, "max": 256, "help": "worker processes that share this machine's device memory (tandem serve sets it to the workers it starts; set it in each unit when several run on one GPU): each takes an equal share, which an auto KV budget, the GPU weight format and MLX's memory limit come from"})
    kv_initial_tokens: int | None = field(default=None, metadata={"min": 0, "help": "KV store allocated at start, in tokens (within the pool size); it grows by doubling past that, each growth a copy of the whole store inside an engine step; unset = parallel x prefill_chunk_size / 2, a full engine of mid-length prompts, so a burst does not grow it on its way in"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prompt prefixes"})
    fast_forward: bool = field(default=True, metadata={"help": "on the CPU, run llama-family models (llama, qwen2, qwen3) through tandem's own forward (fused projections, cheaper exponentials; docs/cpu-performance.md) instead of mlx-lm's"})
    native_kernels: bool = field(default=True, metadata={"help": "on the CPU, run tandem's C kernels: decode attention over the contiguous mirror and its fill, and for a model loaded from 4-bit weights the whole decode step as one C call that multiplies the packed weights directly (values identical to the dense ones) and the RoPE and SiLU of prefills; needs a C compiler (the 4-bit ones AVX-512), else the mlx/MKL path runs; false keeps every C kernel out"})
    cpus: str | None = field(default=None, metadata={"help": "CPUs the engine thread may run on (Linux), e.g. 3 or 2,3 or 4-7; unset = wherever the OS schedules it. On a GPU one thread encoding every kernel sets the small-batch step, and its speed moved by 1.6x from process to process"})
    decode_graphs: bool = field(default=True, metadata={"help": "on a GPU, run greedy decode steps (up to 128 rows) as CUDA graphs of tandem's kernels, captured per row class and table width: one row when the engine starts (7-15 s on the 8B shape), every row class of the batch in the worker's warm-up; a prefill-role worker, which never decodes, turns it off"})
    decode_mirror: bool = field(default=True, metadata={"help": "keep the decode batch's KV contiguous as well as paged (faster attention on the CPU; costs one dense copy of the batch's KV)"})

    def resolve(self, on_cpu: bool) -> "EngineSettings":
        """Fill the settings left unset with their backend's default (``parallel``); the
        engine and a worker's role settings call it before reading them."""
        if self.parallel is None:
            self.parallel = CPU_PARALLEL if on_cpu else GPU_PARALLEL
        return self


@dataclass
class SpeculativeSettings:
    """Section [speculative]: drafting tokens that a decode step verifies in the batch."""

    mode: str = field(default="auto", metadata={"help": "auto (ngram on the CPU, where the one C decode step verifies every drafted position and the measured cost keeps wide batches from drafting; off on a GPU, whose runner still verifies through its prefill path); off; ngram (prompt lookup: propose what followed the last tokens' earlier occurrence; pays where the output copies its input); or draft:PATH (a smaller mlx-lm model with the target's tokenizer, loaded beside it)"})
    max_draft: int = field(default=4, metadata={"min": 1, "max": 16, "help": "most tokens one sequence drafts per step"})
    ngram_min: int = field(default=2, metadata={"min": 1, "max": 16, "help": "shortest run of last tokens the prompt lookup matches"})
    ngram_max: int = field(default=4, metadata={"min": 1, "max": 16, "help": "longest run of last tokens the prompt lookup matches (tried first)"})
    retry_steps: int = field(default=16, metadata={"min": 1, "help": "steps without drafting after which a sequence's acceptance estimate is raised just above what a drafted token costs (measured), so a lone one tries a token again"})

    def draft_path(self) -> str | None:
        """The draft model's path for ``draft:PATH``; None for auto, off and ngram. Raises
        ValueError for any other mode."""
        if self.mode in ("auto", "off", "ngram"):
            return None
        kind, sep, path = self.mode.partition(":")
        if kind != "draft" or not sep or not path.strip():
            raise ValueError(f"speculative.mode={self.mode!r}: expected auto, off, ngram or draft:PATH")
        return path.strip()

    def resolved(self, on_cpu: bool) -> str:
        """The mode that runs: auto is ngram on the CPU and off elsewhere."""
        if self.mode == "auto":
            return "ngram" if on_cpu else "off"
        return self.mode
