"""The URL shapes the sidecar accepts for its engines: the local one and each prefill target."""

from __future__ import annotations

from urllib.parse import urlsplit


def check_engine_url(value: str) -> str:
    """The local engine's base URL, ``http(s)://host[:port]``, without a trailing slash;
    ValueError for any other shape."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("engine URL must be http(s)://host[:port]")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("engine URL must not carry a query, fragment or credentials")
    _ = parts.port  # raises ValueError for a port that is not a number in range
    if parts.path not in ("", "/"):
        # The sidecar appends the engine's own paths (/v1/completions, /health): a base
        # path would send every call to /v1/v1/... and /ready would stay 503.
        raise ValueError(
            f"engine URL must not carry a path ({parts.path!r}): the sidecar adds the "
            f"engine's paths (/v1/..., /health) itself; write "
            f"{parts.scheme}://{parts.netloc}"
        )
    # Paths are joined onto it, so a trailing slash would double.
    return value.rstrip("/")


def check_prefill_url(url: str) -> None:
    """Raise ValueError unless ``url`` is exactly ``http(s)://host:port``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"prefill URL {url!r}: {exc}") from None
    if parts.scheme in ("http", "https") and parts.hostname and parts.path and not (
            parts.query or parts.fragment or "?" in url or "#" in url):
        raise ValueError(
            f"prefill URL {url!r} must not carry a path ({parts.path!r}): the sidecar adds "
            f"/v1/... itself; write {parts.scheme}://{parts.netloc}"
        )
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port is None
        or port == 0
        or parts.path
        or parts.query
        or parts.fragment
        or "?" in url
        or "#" in url
        or parts.username is not None
        or parts.password is not None
    ):
        raise ValueError(f"prefill URL {url!r} must be http(s)://host:port with nothing else")
