"""A dialect from outside the sidecar: the engine "acme", registered by an entry point only."""
