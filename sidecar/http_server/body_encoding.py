"""The rule for a request body sent with a ``Content-Encoding``: decoded here, or refused.

aiohttp inflates a body whose one ``Content-Encoding`` is ``gzip``, ``deflate``, ``br`` or
``zstd`` (``br`` and ``zstd`` only with their libraries installed; without them aiohttp
refuses the request itself) before any handler reads it. So the sidecar forwards the inflated
bytes, with their own length and without the header (``core.upstream`` never forwards it):
an engine reads exactly the bytes the sidecar counted, checked and sent. Forwarding the
header, or the client's compressed length, over inflated bytes is how a body smuggled a
second request into the engine's connection. Any other coding (an unknown one, a list of
codings, two headers) is refused with 415 ``unsupported_content_encoding`` on every path:
aiohttp leaves such a body as sent, and no engine of this project decodes request bodies.

    Content-Encoding   absent / identity  -> PLAIN    forwarded as received
                       gzip|deflate|br|zstd -> DECODED forwarded inflated, true length
                       anything else      -> 415

Deliberate limit: an inflated passthrough body is read whole (under ``--max-body-bytes``,
which counts inflated bytes) before the engine is called, so that its length is known.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from multidict import CIMultiDictProxy

from sidecar.errors import UnsupportedContentEncoding

CONTENT_ENCODING: Final = "Content-Encoding"

#: The codings aiohttp inflates on its own (its parser's rule: one header, ASCII, any case;
#: ``tests/http/test_aiohttp_private.py`` holds the installed aiohttp to it).
INFLATED_BY_AIOHTTP: Final = frozenset({"gzip", "deflate", "br", "zstd"})


class BodyCoding(Enum):
    """How the body a handler reads relates to the bytes the client sent."""

    PLAIN = "plain"  # the client's own bytes
    INFLATED = "inflated"  # aiohttp decoded them: their length is not the client's


def body_coding(headers: CIMultiDictProxy[str]) -> BodyCoding:
    """What the request's ``Content-Encoding`` made of its body; raises
    ``UnsupportedContentEncoding`` for a coding the sidecar does not decode."""
    values = headers.getall(CONTENT_ENCODING, [])
    if not values:
        return BodyCoding.PLAIN
    if len(values) == 1 and values[0].isascii():
        coding = values[0].lower()
        if coding in INFLATED_BY_AIOHTTP:
            return BodyCoding.INFLATED
        if coding == "identity":
            return BodyCoding.PLAIN
    raise UnsupportedContentEncoding(
        "request body Content-Encoding is not supported: send it plain or with one of "
        "gzip, deflate (one Content-Encoding header, one coding)")
