"""``--workers N``: one sidecar as N processes on the same ports, under one supervisor.

    identity          which worker a process is (index of count, run directory); SOLO
    cores             ``--workers auto``: the cores the container may use
    ports             the supervisor's hold on the shared ports (SO_REUSEPORT)
    shared_inflight   ``--max-inflight`` across the pool: one counter slot per worker
    supervisor        spawns the workers, restarts a dead one, forwards SIGTERM, cleans up
    entry             a worker process: its settings from the run directory, then serve

Nothing here is imported by a lone process beyond ``identity`` and ``shared_inflight``'s
type; with ``--workers 1`` (the default) ``disagg-sidecar serve`` runs as it always did.
"""
