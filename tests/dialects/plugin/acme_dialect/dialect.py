"""The "acme" engine's dialect, as a third party would write it (tests/dialects/
test_plugin_dialect.py runs it).

Acme pairs its legs by a session the sidecar names and a ticket its prefill answers with:

    prefill body = common rules + {"acme_session": "<acme_session_tag>-<request id>"}
    prefill answer carries {"acme_ticket": {...}}
    decode body  = client body + {"acme_ticket": <that ticket>, "acme_session": <the session>}

It adds one setting of its own (``acme_session_tag``) and streams token ids when asked with
``acme_token_ids: true``. Nothing of the sidecar names it: an entry point in the group
``disagg_sidecar.dialects`` does (``acme_dialect-1.0.dist-info/entry_points.txt``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import Field

from sidecar.dialects.base import Dialect, DialectOptions, DialectSetup
from sidecar.errors import InvalidHandoff
from sidecar.protocol.context import HandoffContext

SESSION = "acme_session"
TICKET = "acme_ticket"


class AcmeOptions(DialectOptions):
    acme_session_tag: str = Field(default="acme", min_length=1,
                                  description="Prefix of the Acme sessions this sidecar names.")


class AcmeDialect(Dialect):
    engine = "acme"
    checked_against = "Acme 1.0 (a test engine)"
    handoff_keys = frozenset({SESSION, TICKET})
    token_id_fields = MappingProxyType({"acme_token_ids": True})
    Options = AcmeOptions

    def __init__(self, setup: DialectSetup) -> None:
        super().__init__(setup)
        self.tag = AcmeOptions.of(setup.settings).acme_session_tag

    def begin(self, ctx: HandoffContext) -> HandoffContext:
        return ctx.with_state(f"{self.tag}-{ctx.request_id}")

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return {SESSION: ctx.state}

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        ticket = None if prefill_response is None else prefill_response.get(TICKET)
        if not isinstance(ticket, Mapping):
            raise InvalidHandoff("the Acme prefill answered without a ticket")
        return {TICKET: dict(ticket), SESSION: ctx.state}
