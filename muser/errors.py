"""Errors a user can act on: the CLI prints their message on one line and exits non-zero."""

from __future__ import annotations


class MuserError(Exception):
    """A user-facing failure with a one-line explanation."""


class ConfigError(MuserError, ValueError):
    """An engine configuration that cannot run (muser/config.py's EngineConfig checks)."""


class ModelLoadError(MuserError):
    """The model file is missing, corrupt, truncated or of an unsupported kind."""


class GenerationError(MuserError):
    """The engine ended a request before its end, for a reason it names (e.g. a grammar whose
    token mask ran past its budget)."""
