"""Errors a user can act on: the CLI prints their message on one line and exits non-zero."""

from __future__ import annotations


class MuserError(Exception):
    """A user-facing failure with a one-line explanation."""


class ModelLoadError(MuserError):
    """The model file is missing, corrupt, truncated or of an unsupported kind."""
