"""The sidecar benchmark (see bench/README.md)."""
