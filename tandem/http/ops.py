"""Operational endpoints: /health, /ready, /metrics, /v1/stats, /v1/models."""

from __future__ import annotations

import asyncio
import time

import falcon

from tandem.http.errors import ApiError, unavailable
from tandem.http.metrics import CONTENT_TYPE
from tandem.http.responses import dumps

_PROBE_TIMEOUT_S = 2.0
# Keys whose values reveal the cluster's topology; /v1/stats is reachable by clients.
_SECRET_WORDS = frozenset({"address", "addr", "addrs", "addresses", "endpoint", "host", "ip", "identity", "ingest", "peer", "peers", "secret", "url", "port"})


def redact(value):
    """Drop addresses, identities and secrets from a stats tree; keep numbers and names."""
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()
                if _SECRET_WORDS.isdisjoint(str(k).lower().replace("-", "_").split("_"))}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def _json(resp, body, status=falcon.HTTP_200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = dumps(body)


class HealthResource:
    async def on_get(self, req, resp):
        _json(resp, {"status": "ok"})


class ReadyResource:
    """Ready when the broker answers and every role a request needs has a worker."""

    def __init__(self, edge):
        self.edge = edge

    async def on_get(self, req, resp):
        try:
            backend = await self.edge.get_backend()
            info = await asyncio.wait_for(backend.ready(), _PROBE_TIMEOUT_S)
        except Exception as exc:
            _json(resp, {"ready": False, "broker": False, "reason": f"broker unreachable: {exc or type(exc).__name__}"}, falcon.HTTP_503)
            return
        workers = info.get("workers") or {}
        hybrid = int(workers.get("hybrid", 0) or 0)
        split = int(workers.get("prefill", 0) or 0) > 0 and int(workers.get("decode", 0) or 0) > 0
        ready = bool(info.get("broker")) and (hybrid > 0 or split)
        body = {"ready": ready, "broker": bool(info.get("broker")), "workers": workers}
        if not ready:
            body["reason"] = "no hybrid worker and no prefill+decode pair is connected"
        _json(resp, body, falcon.HTTP_200 if ready else falcon.HTTP_503)


class MetricsResource:
    def __init__(self, edge):
        self.edge = edge

    async def on_get(self, req, resp):
        try:
            backend = await self.edge.get_backend()
            cluster = await asyncio.wait_for(backend.stats(), _PROBE_TIMEOUT_S)
        except Exception:
            cluster = None  # tandem_broker_up 0 says so
        resp.content_type = CONTENT_TYPE
        resp.data = self.edge.metrics.render(cluster)


class StatsResource:
    def __init__(self, edge):
        self.edge = edge

    async def on_get(self, req, resp):
        if not self.edge.settings.expose_stats:
            raise ApiError(404, "stats are disabled on this server (edge.expose_stats)", code="not_found")
        try:
            backend = await self.edge.get_backend()
            stats = await asyncio.wait_for(backend.stats(), _PROBE_TIMEOUT_S)
        except Exception as exc:
            raise unavailable(str(exc) or type(exc).__name__) from None
        _json(resp, redact(stats))


def _model_card(edge) -> dict:
    return {"id": edge.model_name, "object": "model", "created": _STARTED, "owned_by": "tandem"}


_STARTED = int(time.time())


class ModelsResource:
    def __init__(self, edge):
        self.edge = edge

    async def on_get(self, req, resp):
        _json(resp, {"object": "list", "data": [_model_card(self.edge)]})


class ModelResource:
    def __init__(self, edge):
        self.edge = edge

    async def on_get(self, req, resp, model_id):
        if model_id != self.edge.model_name:
            raise ApiError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
        _json(resp, _model_card(self.edge))
