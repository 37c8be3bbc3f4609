"""``--workers N``: one sidecar as N processes on the same ports, under one supervisor.

    identity          which worker a process is (index of count, run directory); SOLO
    cores             ``--workers auto``: the cores the container may use
    ports             the supervisor's hold on the shared ports (SO_REUSEPORT)
    shared_inflight   ``--max-inflight`` across the pool: one counter slot per worker
    supervisor        spawns the workers, restarts a dead one, forwards SIGTERM, cleans up
    entry             a worker process: its settings from the run directory, then serve

With ``--workers 1`` (the default) ``disagg-sidecar serve`` runs as it always did: no
supervisor, and the lone process is ``identity.SOLO`` (one lane, nothing shared).
"""
