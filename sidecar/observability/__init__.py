"""What operators see: Prometheus metrics, OpenTelemetry traces and the process's logs.

    metrics.py   every metric of the sidecar (one registry; multiprocess mode with workers)
    tracing.py   request and leg spans, W3C context in and out, a no-op path when off
    logs.py      plain-text or JSON log lines (with trace ids and the worker's index)
"""
