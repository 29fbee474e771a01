"""The HTTP edge: an OpenAI-compatible Falcon ASGI app (SSE streaming) that gunicorn runs.

Entry points: ``tandem.http.app.create_app(config, backend=None, tokenizer=None)`` and,
for gunicorn, ``tandem.http.app:gunicorn_app()``; see docs/http.md. Nothing is imported
here, so loading the configuration (which reads ``settings``) stays cheap.
"""
