"""The `tandem` subcommands, one module each (tandem/cli.py builds the parser from them)."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""
