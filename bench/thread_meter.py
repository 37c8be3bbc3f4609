"""CPU of named processes over a window, counted thread by thread (and child by child).

    meter = ThreadMeter({"smg": pid, ...}, trees=frozenset({"smg"}))
    meter.start(); ...; cpu_s = meter.stop()     # seconds per name, as load.CpuMeter
    meter.exited                                 # threads that ended inside the window

The same interface as ``bench.load.CpuMeter`` (the load phases take either), but each
reading is every living thread's CPU (``procs.thread_cpu_ns``) and a window's CPU is the
sum of each thread's difference: a thread started inside the window counts whole, one that
ended inside it cannot make the sum smaller. Summing the living threads at both ends, as
``CpuMeter`` does, is exact only while no thread ends; the compiled routers' async runtimes
(tokio) start and end threads of their own, so they are measured this way. What an ended
thread spent inside the window is lost with it; ``exited`` says how many did, so a reader
knows whether that happened (in this bench's runs: see ``threads_exited`` in the JSON).

Deliberate limits: a window's CPU of a thread id the kernel reused inside the window is its
new thread's whole life; Linux only.
"""

from __future__ import annotations

from collections.abc import Mapping

from bench import load, procs


class ThreadMeter(load.CpuMeter):
    """``load.CpuMeter`` with per-thread differences; ``trees``: count descendants too."""

    def __init__(self, pids: Mapping[str, int], trees: frozenset[str] = frozenset()) -> None:
        super().__init__(pids, trees)
        self._threads: dict[str, dict[tuple[int, int], int]] = {}
        self.exited: dict[str, int] = {}

    def _snapshot(self) -> dict[str, dict[tuple[int, int], int]]:
        return {name: procs.thread_cpu_ns(pid, tree=name in self.trees)
                for name, pid in self.pids.items()}

    def start(self) -> None:
        self._threads = self._snapshot()

    def stop(self) -> dict[str, float]:
        end = self._snapshot()
        out: dict[str, float] = {}
        self.exited = {}
        for name, threads in end.items():
            before = self._threads.get(name, {})
            total = 0
            for key, ns in threads.items():
                was = before.get(key, 0)
                # A smaller reading is a reused thread id: a new thread, counted whole.
                total += ns - was if ns >= was else ns
            gone = len(before.keys() - threads.keys())
            if gone:
                self.exited[name] = gone
            out[name] = total / 1e9
        return out
