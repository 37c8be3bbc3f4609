"""One module per HTTP API the sidecar runs as prefill/decode pairs, selected by route.

    api_of(Route.RESPONSES) ─▶ the Responses API's rules (``responses.py``)

    completions.py   /v1/completions, /v1/chat/completions (OpenAI)
    responses.py     /v1/responses (OpenAI Responses)
    messages.py      /v1/messages (Anthropic Messages)
    generate.py      /inference/v1/generate (token ids in and out)

What an API module owns is the API's, whatever engine serves it: the fields the sidecar reads,
its prefill rules, its state rule, its stream markers, its usage rule and its error shapes
(``base.Api``). Where an engine's hand-off goes, and which routes an engine runs as pairs, is
engine knowledge: the dialects' (``sidecar.dialects``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from sidecar.protocol.apis.base import Api, usage_of
from sidecar.protocol.apis.completions import ChatApi, CompletionsApi
from sidecar.protocol.apis.generate import GenerateApi
from sidecar.protocol.apis.messages import MessagesApi
from sidecar.protocol.apis.responses import ResponsesApi
from sidecar.protocol.context import Route

APIS: Final[Mapping[Route, Api]] = MappingProxyType({
    api.route: api
    for api in (CompletionsApi(), ChatApi(), ResponsesApi(), MessagesApi(), GenerateApi())
})

#: Every top-level key some API reads or rewrites (duplicates are refused on every route).
CONTROL_KEYS: Final[frozenset[str]] = frozenset().union(*(a.control_keys for a in APIS.values()))


#: The rules of a route's API: ``api_of(route)`` (a lookup in ``APIS``, no call of its own).
api_of: Final[Callable[[Route], Api]] = APIS.__getitem__


__all__ = ["APIS", "CONTROL_KEYS", "Api", "api_of", "usage_of"]
