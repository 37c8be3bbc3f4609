"""vLLM MooncakeConnector (seed name ``mooncake``): push model, prefill and decode at once.

contracts.md section 2.3, confirmed against vLLM's ``MooncakeConnectorMetadata.add_new_req``
(decode reads ``transfer_id``, ``remote_engine_id``, ``remote_bootstrap_addr``) and its
Mooncake proxy example:

    assign_ids: ctx.mooncake_transfer_id := ids.transfer_id()       ("xfer-<uuid>")
    prefill kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
                                  transfer_id: T}
    decode kv_transfer_params  = {do_remote_decode: false, do_remote_prefill: true,
                                  transfer_id: T,
                                  remote_bootstrap_addr: "http://<advertise host>:<port>",
                                  remote_engine_id: E}

``E`` comes from the prefill's bootstrap server, ``GET <remote_bootstrap_addr>/query``; the
core fetches and caches it (parsed by this agent's ``parse_engine_id``) and puts it in
``ctx.mooncake_engine_id``. ``engine_id_from_query`` reads both answer shapes vLLM has shipped:

    {"<dp_rank>": {"engine_id": E, "worker_addr": {...}, ...}, ...}     (dict[int, EngineEntry])
    {"<E>": {"<dp_rank>": {"<tp_rank>": {"<pp_rank>": addr}}}, ...}    (dict[EngineId, ...])

Deliberate limits: the prefill response carries no params and is not read; the data-parallel
rank header (``X-data-parallel-rank``) is the orchestrator's business, as is aborting decode
when the concurrent prefill fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.errors import InvalidHandoff, SidecarError
from sidecar.ids import IdSources
from sidecar.kv_agents.base import KVTransferAgent
from sidecar.protocol.context import HandoffContext
from sidecar.protocol.hostfmt import http_url

KV_TRANSFER_PARAMS = "kv_transfer_params"
ENGINE_ID = "engine_id"


def _is_rank_key(key: object) -> bool:
    """True for a JSON object key that names a rank (an int, or its decimal text)."""
    if isinstance(key, bool):
        return False
    if isinstance(key, int):
        return key >= 0
    return isinstance(key, str) and key.isascii() and key.isdigit()


def _has_rank(entry: Mapping[Any, Any], rank: int) -> bool:
    return str(rank) in entry or rank in entry


def engine_id_from_query(payload: object, dp_rank: int = 0) -> str:
    """The prefill engine id for ``dp_rank`` from a bootstrap ``/query`` answer.

    Raises ``InvalidHandoff`` for any other shape, a missing rank, or an ambiguous answer
    (several engines serving the same rank).
    """
    if not isinstance(payload, Mapping) or not payload:
        raise InvalidHandoff("Mooncake /query answer is not a non-empty object")
    entries = list(payload.items())
    if all(isinstance(value, Mapping) and ENGINE_ID in value for _, value in entries):
        # Shape 1: keyed by data-parallel rank.
        entry = payload.get(str(dp_rank), payload.get(dp_rank))
        if entry is None:
            ranks = ", ".join(sorted(str(key) for key in payload))
            raise InvalidHandoff(
                f"Mooncake /query answer has no data-parallel rank {dp_rank} (ranks: {ranks})"
            )
        engine_id = entry[ENGINE_ID]
        if not isinstance(engine_id, str) or not engine_id:
            raise InvalidHandoff("Mooncake /query answer has an engine_id that is not a string")
        return engine_id
    if all(
        isinstance(key, str)
        and key
        and isinstance(value, Mapping)
        and all(_is_rank_key(rank) for rank in value)
        for key, value in entries
    ):
        # Shape 2: keyed by engine id, then data-parallel rank.
        matches = [key for key, value in entries if _has_rank(value, dp_rank)]
        if len(matches) == 1:
            return str(matches[0])
        if not matches:
            raise InvalidHandoff(
                f"Mooncake /query answer has no engine serving data-parallel rank {dp_rank}"
            )
        raise InvalidHandoff(
            f"Mooncake /query answer has {len(matches)} engines serving data-parallel rank "
            f"{dp_rank}; cannot tell which one holds the KV"
        )
    raise InvalidHandoff("Mooncake /query answer has an unknown shape")


class MooncakeAgent(KVTransferAgent):
    """Concurrent legs paired by a router-chosen ``transfer_id``."""

    name = "mooncake"
    concurrent = True
    needs_engine_id = True
    handoff_keys = frozenset({KV_TRANSFER_PARAMS})
    checked_against = (
        "vLLM main (2026 snapshot) MooncakeConnector (transfer_id, remote_bootstrap_addr, "
        "remote_engine_id) and its bootstrap /query, both answer shapes"
    )

    def parse_engine_id(self, payload: object) -> str:
        return engine_id_from_query(payload)

    def assign_ids(self, ctx: HandoffContext, ids: IdSources) -> HandoffContext:
        return ctx.with_ids(mooncake_transfer_id=ids.transfer_id())

    def prefill_fields(self, ctx: HandoffContext) -> dict[str, Any]:
        return {
            KV_TRANSFER_PARAMS: {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": self._transfer_id(ctx),
            }
        }

    def handoff(
        self, prefill_response: Mapping[str, Any] | None, ctx: HandoffContext
    ) -> dict[str, Any]:
        if not ctx.mooncake_engine_id:
            raise InvalidHandoff(
                "Mooncake decode needs the prefill engine id (bootstrap /query gave none)"
            )
        return {
            KV_TRANSFER_PARAMS: {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "transfer_id": self._transfer_id(ctx),
                # vLLM's decode appends "/query" to it, so the scheme is required.
                "remote_bootstrap_addr": http_url(
                    ctx.advertise_host, ctx.mooncake_bootstrap_port
                ),
                "remote_engine_id": ctx.mooncake_engine_id,
            }
        }

    @staticmethod
    def _transfer_id(ctx: HandoffContext) -> str:
        if ctx.mooncake_transfer_id is None:
            raise SidecarError("Mooncake request has no transfer id (assign_ids not called)")
        return ctx.mooncake_transfer_id
