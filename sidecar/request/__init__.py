"""One request's decision and run, the same for both front doors: its scope (admission,
outcome, metrics), where it runs (placement), how its legs run (the runner), and what the
relay reads (the exchange)."""
