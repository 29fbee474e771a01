"""The Falcon ASGI app: ``create_app(config, backend=None, tokenizer=None)``.

gunicorn imports the app in its master (``preload_app``: the tokenizer is loaded
once and shared copy-on-write) and forks workers; the wire client holds ZeroMQ
sockets, which must not cross a fork, so each worker builds its own in the ASGI
lifespan startup (or on the first request when lifespan is off).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
from pathlib import Path

import falcon
import falcon.asgi

from tandem.http.backend import Backend, make_backend
from tandem.http.completions import CompletionsResource
from tandem.http.console import ConsoleResource, load_assets
from tandem.http.errors import ApiError, handle_error
from tandem.http.metrics import EdgeMetrics
from tandem.http.ops import HealthResource, MetricsResource, ModelResource, ModelsResource, ReadyResource, StatsResource
from tandem.http.settings import EdgeSettings
from tandem.http.tokenizer import EdgeTokenizer, load_tokenizer

log = logging.getLogger("tandem.edge")


class Edge:
    """Per-process state the resources share: settings, tokenizer, metrics, backend."""

    def __init__(self, config, backend: Backend | None, tokenizer: EdgeTokenizer, model_name: str, api_key: bytes | None):
        self.config = config
        self.settings: EdgeSettings = config.edge
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = EdgeMetrics()
        self.reasoning = reasoning_markers(self.settings.reasoning, tokenizer)
        self._backend = backend
        self._backend_pid = os.getpid() if backend is not None else None
        self._started = False
        self._lock: asyncio.Lock | None = None

    @functools.cached_property
    def grammar_tokenizer(self):
        """llguidance's view of the tokenizer, to refuse a grammar the workers could not
        run with a 400 before it is submitted; built on first use (about 1 s)."""
        from tandem.pipeline.grammar import build_tokenizer

        tok = self.tokenizer
        return build_tokenizer(tok.hf, tok.vocab_size, tok.eos_token_ids)

    async def get_backend(self) -> Backend:
        if self._backend is None or self._backend_pid != os.getpid():
            # Built in this process: a client inherited across fork() shares sockets.
            self._backend = make_backend(self.config)
            self._backend_pid = os.getpid()
            self._started = False
        if not self._started:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if not self._started:
                    await self._backend.start()
                    self._started = True
        return self._backend

    async def close(self) -> None:
        if self._backend is not None and self._started and self._backend_pid == os.getpid():
            await self._backend.close()
            self._started = False


class _Lifespan:
    def __init__(self, edge: Edge):
        self.edge = edge

    async def process_startup(self, scope, event):
        try:
            await self.edge.get_backend()
        except ImportError:
            raise
        except Exception as exc:  # a broker that is down now may come up later: /ready says so
            log.warning("wire client did not start: %s (requests will retry)", exc)

    async def process_shutdown(self, scope, event):
        await self.edge.close()


class _Auth:
    """Bearer-token check for /v1/*; health, readiness and metrics stay open for probes."""

    def __init__(self, edge: Edge):
        self.edge = edge

    async def process_request(self, req, resp):
        if self.edge.api_key is None or not req.path.startswith("/v1/") or req.method == "OPTIONS":
            return  # a CORS preflight carries no credentials; the request after it does
        header = req.get_header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare_digest takes time independent of where the strings differ.
        if not hmac.compare_digest(supplied, self.edge.api_key):
            self.edge.metrics.refuse("unauthorized")
            raise ApiError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def cors_origins(setting: str) -> str | list[str] | None:
    """``edge.cors_origins`` as Falcon takes it: None (off), "*" or a list of origins."""
    value = (setting or "").strip()
    if not value:
        return None
    if value == "*":
        return "*"
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    for o in origins:
        if not o.startswith(("http://", "https://")):
            raise ValueError(f"edge.cors_origins: {o!r} is not an origin such as https://app.example.com")
    return origins


def reasoning_markers(setting: str, tokenizer: EdgeTokenizer) -> tuple[str, str] | None:
    """The (start, end) thinking markers of ``edge.reasoning``; raise ValueError on a bad value."""
    value = (setting or "off").strip()
    if value == "off":
        return None
    if value == "auto":
        vocab = tokenizer.hf.get_vocab() if hasattr(tokenizer.hf, "get_vocab") else {}
        return ("<think>", "</think>") if "<think>" in vocab and "</think>" in vocab else None
    start, sep, end = value.partition(",")
    if not sep or not start.strip() or not end.strip():
        raise ValueError(f"edge.reasoning={setting!r}: expected auto, off or START,END (two markers)")
    return start.strip(), end.strip()


def _model_dir(config) -> Path:
    if config.model.path:
        path = Path(config.model.path).expanduser()
        if not path.exists():
            from tandem.pipeline.model_store import hf_snapshot, looks_like_repo_id

            if looks_like_repo_id(config.model.path):
                return hf_snapshot(config.model.path)
        return path
    try:
        from tandem.pipeline.model_store import default_model_dir
    except ImportError:
        raise ValueError("no model directory configured; pass --model PATH") from None
    return Path(default_model_dir())


def _api_key(settings: EdgeSettings) -> bytes | None:
    if not settings.api_key_file:
        return None
    try:
        key = Path(settings.api_key_file).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {settings.api_key_file}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"the API key file {settings.api_key_file} is empty")
    return key


class EdgeApp(falcon.asgi.App):
    """The Falcon app, carrying its :class:`Edge` (tests and the gunicorn hooks read it)."""

    edge: Edge


def create_app(config=None, backend: Backend | None = None, tokenizer: EdgeTokenizer | None = None) -> EdgeApp:
    """Build the edge. ``backend`` and ``tokenizer`` default to the production ones."""
    if config is None:
        from tandem.config import load

        config = load()
    model_name = config.edge.model_name
    if tokenizer is None or model_name is None:
        model_dir = _model_dir(config)
        if tokenizer is None:
            tokenizer = load_tokenizer(model_dir)
        from_repo = config.model.path and not Path(config.model.path).expanduser().exists()
        model_name = model_name or (config.model.path if from_repo else model_dir.name)
    edge = Edge(config, backend, tokenizer, model_name, _api_key(config.edge))
    middleware = [_Lifespan(edge), _Auth(edge)]
    origins = cors_origins(config.edge.cors_origins)
    if origins is not None:
        # Opt-in: a browser page on another origin may call the API (the API key still applies).
        middleware.insert(0, falcon.CORSMiddleware(allow_origins=origins, expose_headers=["Retry-After"]))
    app = EdgeApp(middleware=middleware, cors_enable=False)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler(Exception, handle_error)
    app.add_error_handler(falcon.HTTPError, handle_error)
    app.add_route("/v1/chat/completions", CompletionsResource(edge, "chat"))
    app.add_route("/v1/completions", CompletionsResource(edge, "completion"))
    app.add_route("/v1/models", ModelsResource(edge))
    app.add_route("/v1/models/{model_id}", ModelResource(edge))
    app.add_route("/v1/stats", StatsResource(edge))
    app.add_route("/health", HealthResource())
    app.add_route("/ready", ReadyResource(edge))
    app.add_route("/metrics", MetricsResource(edge))
    if config.edge.console:
        console = ConsoleResource(load_assets(), api_key_required=edge.api_key is not None)
        app.add_route("/", console)
        app.add_route("/console/{name}", console, suffix="asset")
    app.edge = edge  # for tests and the gunicorn config
    return app


def gunicorn_app() -> falcon.asgi.App:
    """Entry point for gunicorn (``tandem.http.app:gunicorn_app()``): config from the
    environment that ``tandem edge`` prepared."""
    from tandem.config import load

    return create_app(load())
