"""A lean pooled HTTP/1.1 client for the sidecar's engine calls (see ``client``)."""

from sidecar.http1.client import EngineClient
from sidecar.http1.errors import (
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
)
from sidecar.http1.response import UpstreamResponse

__all__ = [
    "EngineClient",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamResponse",
]
