"""A lean pooled HTTP/1.1 client for the sidecar's engine calls (see ``client``)."""

from sidecar.http1.client import EngineClient
from sidecar.http1.connection import UpstreamResponse
from sidecar.http1.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTLSError,
)

__all__ = [
    "EngineClient",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTLSError",
]
