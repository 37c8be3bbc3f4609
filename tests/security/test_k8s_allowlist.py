"""Proves the Kubernetes-mode allowlist (``sidecar.targets.kubernetes``) with a fake pod source:
which pods count as targets (Running, with an IP, not being deleted, port from the label or
the default), that host and port are both checked, that LIST replaces and WATCH events
update the set (an IP that moved is refused at once), that the watch resumes from the last
resource version, relists on 410 and after errors keeping the last known set, that nothing
is allowed before the first list, and that the target selector refuses what it refuses.

Does not talk to a real API server (``KubernetesPodSource`` is a thin adapter over
kubernetes_asyncio's LIST and WATCH calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from sidecar.errors import TargetNotAllowed
from sidecar.targets.allowlist import Allowlist
from sidecar.targets.kubernetes import PodAllowlist, WatchExpired, pod_target, watch_pods
from sidecar.targets.selector import TargetSelector

PORT_LABEL = "model.aibrix.ai/port"


def pod(name: str, ip: str | None = "10.0.0.7", port: str | None = "8000", *,
        phase: str = "Running", deleting: bool = False, rv: str = "1") -> dict[str, Any]:
    labels = {PORT_LABEL: port} if port is not None else {}
    metadata: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "labels": labels,
                                "resourceVersion": rv}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def ip(text: str) -> Any:
    return ipaddress.ip_address(text)


def allowlist(**kwargs: Any) -> PodAllowlist:
    return PodAllowlist(port_label=PORT_LABEL, **kwargs)


@pytest.mark.parametrize(("obj", "expected"), [
    (pod("a"), ("10.0.0.7", 8000)),
    (pod("a", port=None), None),
    (pod("a", phase="Pending"), None),
    (pod("a", deleting=True), None),
    (pod("a", ip=None), None),
    (pod("a", ip="not-an-ip"), None),
    (pod("a", port="80a"), None),
    (pod("a", port="70000"), None),
    (pod("a", ip="fd00::7", port="8200"), ("fd00::7", 8200)),
])
def test_which_pods_are_targets(obj: dict[str, Any], expected: tuple[str, int] | None) -> None:
    target = pod_target(obj, PORT_LABEL, None)
    got = None if target is None else (str(target.address), target.port)
    assert got == expected


def test_default_port_applies_without_the_label() -> None:
    target = pod_target(pod("a", port=None), PORT_LABEL, 8000)
    assert target is not None and target.port == 8000


def test_host_and_port_are_both_checked() -> None:
    pods = allowlist()
    assert not pods.allows("10.0.0.7", [ip("10.0.0.7")], 8000)  # before the first list
    pods.replace_all([pod("a"), pod("b", "10.0.0.8", "8100")])
    assert pods.allows("10.0.0.7", [ip("10.0.0.7")], 8000)
    assert pods.allows("10.0.0.8", [ip("10.0.0.8")], 8100)
    assert pods.allows("x", [ip("::ffff:10.0.0.7")], 8000)
    assert not pods.allows("10.0.0.7", [ip("10.0.0.7")], 8100)  # another pod's port
    assert not pods.allows("10.0.0.7", [ip("10.0.0.7")], 22)
    assert not pods.allows("10.0.0.9", [ip("10.0.0.9")], 8000)
    # A name resolving to a pod and to something else is refused whole.
    assert not pods.allows("p.svc", [ip("10.0.0.7"), ip("10.0.0.9")], 8000)
    assert not pods.allows("p.svc", [], 8000)


def test_static_allowlist_still_applies() -> None:
    pods = allowlist(static=Allowlist.parse(["192.168.0.0/16:9000"]))
    pods.replace_all([])
    assert pods.allows("192.168.1.1", [ip("192.168.1.1")], 9000)
    assert not pods.allows("192.168.1.1", [ip("192.168.1.1")], 9001)


def test_watch_events_update_the_set() -> None:
    pods = allowlist()
    pods.replace_all([pod("a")])
    pods.apply("ADDED", pod("b", "10.0.0.8"))
    assert pods.allows("", [ip("10.0.0.8")], 8000)
    pods.apply("MODIFIED", pod("a", "10.0.0.9"))  # rescheduled: the old IP is refused at once
    assert not pods.allows("", [ip("10.0.0.7")], 8000)
    assert pods.allows("", [ip("10.0.0.9")], 8000)
    pods.apply("MODIFIED", pod("b", "10.0.0.8", deleting=True))
    assert not pods.allows("", [ip("10.0.0.8")], 8000)
    pods.apply("DELETED", pod("a", "10.0.0.9"))
    assert pods.targets == []
    pods.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert pods.targets == []


class FakeSource:
    """Scripted LIST answers and WATCH streams; records the resource versions asked for."""

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists = lists
        self.watches = watches
        self.watched_from: list[str] = []
        self.exhausted = asyncio.Event()

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        item = self.lists.pop(0)
        if isinstance(item, Exception):
            raise item
        result: tuple[list[Mapping[str, Any]], str] = item
        return result

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        self.watched_from.append(resource_version)
        if not self.watches:
            self.exhausted.set()
            await asyncio.Event().wait()  # a quiet watch, until cancelled
        script = self.watches.pop(0)
        if isinstance(script, Exception):
            raise script
        for event in script:
            yield event


@contextlib.asynccontextmanager
async def watching(pods: PodAllowlist, source: FakeSource) -> AsyncIterator[None]:
    task = asyncio.ensure_future(watch_pods(pods, source, backoff_s=0.0))
    try:
        async with asyncio.timeout(5):
            await source.exhausted.wait()
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_watch_resumes_relists_on_410_and_survives_errors() -> None:
    pods = allowlist()
    source = FakeSource(
        lists=[
            ([pod("a")], "10"),
            RuntimeError("API down"),  # after the 410: an outage, then the relist works
            ([pod("c", "10.0.0.30", rv="40")], "40"),
        ],
        watches=[
            [("ADDED", pod("b", "10.0.0.8", rv="11")), ("BOOKMARK",
                                                        {"metadata": {"resourceVersion": "12"}})],
            [("DELETED", pod("a", rv="13"))],
            WatchExpired(),
        ],
    )
    async with watching(pods, source):
        assert source.watched_from == ["10", "12", "13", "40"]
        assert [t.name for t in pods.targets] == ["c"]
        assert pods.allows("", [ip("10.0.0.30")], 8000)
        assert not pods.allows("", [ip("10.0.0.8")], 8000)


async def test_selector_refuses_pods_off_the_set() -> None:
    pods = allowlist()
    pods.replace_all([pod("a", "127.0.0.1", "8000")])
    selector = TargetSelector(pods, [], resolve_timeout_s=1.0)
    chosen = await selector.candidates(["127.0.0.1:8000"])
    assert [target.port for target in chosen] == [8000]
    with pytest.raises(TargetNotAllowed):
        await selector.candidates(["127.0.0.1:8001"])
    pods.apply("DELETED", pod("a", "127.0.0.1", "8000"))
    with pytest.raises(TargetNotAllowed):
        await selector.candidates(["127.0.0.1:8000"])


class FakeKubernetesSource(FakeSource):
    """Stands in for ``KubernetesPodSource`` inside a real sidecar (same constructor)."""

    pods: list[dict[str, Any]] = []
    opened: list[tuple[str, str]] = []

    def __init__(self, namespace: str, selector: str) -> None:
        super().__init__(lists=[(list(self.pods), "1")], watches=[])
        self.opened.append((namespace, selector))

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_kubernetes_mode_in_a_running_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar_builders import running_sidecar
    from ssrf_builders import trap
    from test_ssrf import engines, post

    import sidecar.targets.kubernetes as k8s

    async with engines() as (prefill, decode), trap("127.0.0.1") as t:
        monkeypatch.setattr(FakeKubernetesSource, "pods",
                            [pod("prefill-0", "127.0.0.1", str(prefill.port))])
        monkeypatch.setattr(FakeKubernetesSource, "opened", [])
        monkeypatch.setattr(k8s, "KubernetesPodSource", FakeKubernetesSource)
        async with running_sidecar(engine="vllm", engine_url=decode.url, grpc_enabled=False,
                                   prefill_pod_selector="role-name=prefill",
                                   prefill_pod_namespace="llm") as running:
            assert FakeKubernetesSource.opened == [("llm", "role-name=prefill")]
            status, payload = await post(running, f"127.0.0.1:{prefill.port}")
            assert status == 200, payload
            status, payload = await post(running, f"127.0.0.1:{t.port}")
            assert status == 403, payload
            await t.assert_untouched()
