"""The wire layer: everything tandem processes say to each other (spec: docs/protocol.md).

protocol (constants), messages + schema (dataclasses and their checked msgpack form),
codec (frames), errors (WireError), sockets (the socket factory), secret (the cluster
secret), curve (CURVE keys + ZAP for control/token sockets), handshake + sealed (the
cluster handshake and AES-GCM records for KV connections), kvchannel (sealed records
onto a connection from a send arena), kvframes (KVSnapshot <-> messages, strategies),
kv_quant (int8/int4 for transfer), prefixes (routing prefix hashes). client.py (the
broker client) is built on these. The KV-handoff connections are the workers'
(tandem.workers.handoff, sender).
"""
