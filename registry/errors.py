"""Registry failures, each with the HTTP status it maps to."""

from __future__ import annotations


class RegistryError(Exception):
    """Base of registry failures."""

    status_code = 500


class NotFoundError(RegistryError):
    """No such version or alias."""

    status_code = 404


class ConflictError(RegistryError):
    """The version exists with other content: published versions are immutable."""

    status_code = 409


class InvalidError(RegistryError):
    """The input breaks a registry rule."""

    status_code = 422


class UnavailableError(RegistryError):
    """The store cannot be reached; the last loaded view stays in use."""

    status_code = 503
