"""The transport-agnostic core: upstream client, prefill targets (and the choice among them),
the legs, the orchestrator, and the request shapes built on it (fan-out, local prefill)."""
