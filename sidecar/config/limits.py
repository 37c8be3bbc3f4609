"""The settings of a request's life: failure policy, fan-out, local prefill, limits, timeouts.

Part of ``sidecar.config.settings.Settings``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sidecar.config.urls import check_prefill_url


class PrefillFailurePolicy(StrEnum):
    """What a PD request does when its prefill leg fails."""

    FAIL = "fail"
    LOCAL = "local"


class PromptLengthSource(StrEnum):
    """How a text or chat prompt's length is known for conditional disaggregation."""

    ESTIMATE = "estimate"
    TOKENIZE = "tokenize"


class LimitsSettings(BaseModel):
    """How a request runs and what bounds it (sizes, counts, deadlines)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    on_prefill_failure: PrefillFailurePolicy = Field(
        default=PrefillFailurePolicy.FAIL,
        description="When the prefill leg fails: fail (the request fails with the prefill's "
        "error) or local (it runs whole on the local engine, logged and counted: after a "
        "failed leg for sequential dialects only, with every prefill breaker open for all).",
    )
    trusted_router: bool = Field(
        default=False,
        description="Accept the engines' hand-off fields in client bodies: only when the sole "
        "caller is a router that computes them itself.",
    )
    max_fanout: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Most PD pairs one request may fan out to: prompts x n (batched prompts, "
        "n > 1); more: 400.",
    )
    local_prefill_max_tokens: int = Field(
        default=0,
        ge=0,
        description="Prompts of at most this many tokens run whole on the local engine, with "
        "no prefill leg (0: off, every request is disaggregated).",
    )
    local_prefill_max_uncached_tokens: int = Field(
        default=0,
        ge=0,
        description="Prompts with at most this many tokens that the local engine does not "
        "already hold (its longest cached prefix, in whole KV blocks, from its KV events: "
        "--kv-events-endpoint) run whole on the local engine, counted local_cached (0: off). "
        "Text and chat prompts are tokenized by the local engine for this rule.",
    )
    prompt_length_source: PromptLengthSource = Field(
        default=PromptLengthSource.ESTIMATE,
        description="How a text or chat prompt's length is known for "
        "--local-prefill-max-tokens: estimate (UTF-8 bytes / 4, see "
        "docs/driving/request-shapes.md) or tokenize (the local engine's tokenizer endpoint, "
        "for engines that have one). Token-id prompts are "
        "counted exactly.",
    )
    tokenize_timeout_s: float = Field(
        default=0.25,
        gt=0,
        description="The budget of one prompt's tokenize call to the local engine (the "
        "length and cache rules' prompt facts); past it the prompt's tokens are unknown: the "
        "request is decided without them, counted in disagg_tokenize_failures_total, and "
        "never delayed further.",
    )
    placement_header: bool = Field(
        default=True,
        description="Answers of the PD routes carry x-disagg-placement: where the request ran "
        "and why (the placement's outcome, the prompt's tokens and those the local engine "
        "held, a fallback's reason); --no-placement-header leaves it out.",
    )
    prefill_cooldown_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds a prefill target whose connect was refused is skipped while "
        "other listed targets remain (0: never skipped).",
    )
    prefill_breaker_failures: int = Field(
        default=5,
        ge=0,
        description="Failed prefill legs in a row (5xx, resets, garbage, deadlines, refused "
        "or unreachable connects; never a 4xx or 429) that open a prefill target's circuit "
        "breaker: it gets no legs until the cool-down is over (0: no breakers).",
    )
    prefill_breaker_open_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds an open circuit breaker keeps its prefill target out before one "
        "trial leg; each failed trial doubles it, up to 8 times this value.",
    )
    prefill_breaker_successes: int = Field(
        default=2,
        ge=1,
        description="Trial legs (one at a time) that must answer to close a half-open circuit "
        "breaker.",
    )
    migration_limit: int = Field(
        default=1,
        ge=0,
        le=16,
        description="How many times one request may move to another engine when the engine "
        "serving it dies after its answer began (a stream continues token for token where "
        "it broke; a JSON request runs again): 0 turns migration off "
        "(docs/operating/reliability.md#migration).",
    )
    migration_urls: tuple[str, ...] = Field(
        default=(),
        description="Engines that run requests whole, each http(s)://host:port with nothing "
        "else, where a migrated request may continue: the only places for an engine whose "
        "prefill servers cannot run a request whole, else tried after the request's prefill "
        "targets. Repeat "
        "the flag; comma-separated in env.",
    )
    migration_max_stream_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=64 * 1024,
        description="A stream that may move is kept (the engine's bytes) up to this size to "
        "read its token ids back when its engine dies; past it the stream is no longer "
        "migrated.",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="Largest client request body."
    )
    max_body_inflation: float = Field(
        default=20.0,
        ge=1.0,
        description="A gzip or deflate request body inflates to at most this many times the "
        "bytes received (past its first MiB; more: 413): a compressed body costs the sidecar "
        "a small multiple of what its sender paid.",
    )
    max_inflating_body_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1024 * 1024,
        description="Inflated bytes of every compressed request body still being read, "
        "together, at most (past it: 503, retry): one budget for the whole process.",
    )
    client_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Deadline for receiving a client's request body, seconds (slower: 408).",
    )
    client_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Deadline for receiving a client's request head (request line and "
        "headers), seconds, from the connection's start or the first byte of the next "
        "request on a kept-alive one; slower: the connection is closed.",
    )
    max_prefill_response_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest prefill engine response body."
    )
    max_inflight: int = Field(
        default=1024,
        ge=1,
        description="Requests in flight before new ones get 503; with workers, in all of them "
        "together (workers admitting at the same instant may pass it by workers-1).",
    )
    connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Upstream connect timeout, seconds."
    )
    read_timeout_s: float = Field(
        default=300.0, gt=0, description="Upstream per-read timeout, seconds (no total limit)."
    )
    prefill_timeout_s: float = Field(
        default=30.0, gt=0, description="Whole prefill leg deadline, seconds."
    )
    keepalive_s: float = Field(
        default=4.0,
        gt=0,
        description="Idle upstream connection lifetime, seconds (keep it below the engines' own "
        "keep-alive; 5 s is common).",
    )
    max_connections: int = Field(
        default=1024, ge=1, description="Upstream connection pool size."
    )
    drain_grace_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM, seconds to let in-flight requests finish."
    )

    @field_validator("migration_urls")
    @classmethod
    def _migration_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            check_prefill_url(url)
        return value
