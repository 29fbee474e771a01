"""The wire layer: everything tandem processes say to each other (spec: docs/protocol.md).

protocol (constants), messages + schema (dataclasses and their checked msgpack form),
codec (frames), errors (WireError), sockets (the socket factory), secret (the cluster
secret), curve (CURVE keys + ZAP for control/token sockets), handshake + sealed (the
cluster handshake and AES-GCM records for KV connections), kvchannel (KVSender /
KVReceiver), kvframes (KVSnapshot <-> messages), transfer (strategies, ingest,
adaptive selection). client.py (the broker client) is built on these.
"""
