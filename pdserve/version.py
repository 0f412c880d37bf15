"""The installed pdserve's version (``GET /version`` on the orchestrator and every server)."""

from __future__ import annotations

from importlib import metadata


def pdserve_version() -> str:
    """The ``pdserve`` distribution's version; "unknown" when run from a tree that is not installed."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"
