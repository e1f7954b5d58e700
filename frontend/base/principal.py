"""Who a request is, where the HTTP tier's key middleware (`frontend.http.key_middleware`)
leaves it for the wings below that read it (whose stored objects a request may see, which
models it may list): a key of the ASGI scope."""

from __future__ import annotations

PRINCIPAL = "sluice.principal"


def principal_of(scope):
    """The request's `frontend.http.key_table.Principal`, or None (no keys file, or an
    open path)."""
    return scope.get(PRINCIPAL)
