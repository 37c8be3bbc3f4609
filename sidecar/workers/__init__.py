"""``--workers N``: one sidecar as N processes on the same ports, under one supervisor.

    identity          which worker a process is (index of count, run directory); SOLO
    ports             the supervisor's hold on the shared ports (SO_REUSEPORT)
    shared_inflight   ``--max-inflight`` across the pool: one counter slot per worker
    supervisor        spawns the workers, restarts a dead one, forwards SIGTERM, cleans up

A worker process is ``sidecar.worker``; ``--workers auto`` counts cores in
``sidecar.config.cores``; the default, 1, is a lone process (``identity.SOLO``), no supervisor.
"""
