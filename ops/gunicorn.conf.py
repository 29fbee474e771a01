"""gunicorn settings for the tandem edge, for running gunicorn by hand:

    gunicorn -c ops/gunicorn.conf.py

The settings live in the package (``tandem/http/gunicorn_conf.py``) so that an installed
tandem finds them without a source checkout; `tandem edge` loads them as
``-c python:tandem.http.gunicorn_conf``.
"""

from tandem.http.gunicorn_conf import *  # noqa: F401,F403
from tandem.http.gunicorn_conf import child_exit, on_exit  # noqa: F401  (hooks gunicorn looks up by name)
