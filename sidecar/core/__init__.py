"""The transport-agnostic core: upstream client, prefill targets, the legs and the orchestrator."""
