"""Settings owned by the wire layer: the cluster secret (section [security]) and KV transfer ([transfer])."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SecuritySettings:
    cluster_secret_file: str | None = field(default=None, metadata={"help": "file holding the cluster secret (>= 16 bytes)"})
    decode_allowlist: list[str] = field(default_factory=list, metadata={"help": "decode worker node ids or addresses a prefill worker may hand KV to; empty = any authenticated peer"})


@dataclass
class TransferSettings:
    strategy: str = field(default="adaptive", metadata={"choices": ("adaptive", "full", "streamed", "layer_parallel"), "help": "how KV travels from prefill to decode (streamed: during the prefill, for a prompt of several prefill chunks; adaptive tries each and keeps what leaves the least after the prefill)"})
    compression: str = field(default="none", metadata={"choices": ("none", "lz4"), "help": "compress KV frames"})
    quantization: str = field(default="none", metadata={"choices": ("none", "int8", "int4"), "help": "quantize K/V for transfer (int8: |error| <= absmax/254 per block and head)"})
    blocks_per_chunk: int = field(default=64, metadata={"min": 1, "max": 1 << 20, "help": "streamed: KV blocks per chunk message (a prompt of several prefill chunks sends each chunk's blocks while the next one computes)"})
    connections: int = field(default=2, metadata={"min": 1, "max": 16, "help": "layer_parallel: connections per decode peer"})
