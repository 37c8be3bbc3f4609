"""The Kubernetes-mode allowlist: prefill targets are the pods a label selector names.

    PodSource (kubernetes_asyncio: LIST then WATCH pods in a namespace by label selector)
        ─watch_pods()─▶ PodAllowlist.replace_all / .apply(event)
                        allows(host, addresses, port)   (the same interface as Allowlist)

A target is a Running pod with an IP, not being deleted, at its port label's value
(docs/driving/handoffs.md#pod-labels); every resolved address must be one, unless the static
allowlist passes the target. Before the first list, pods are refused. A target that leaves
the set (its pod deleted, stopped, moved to another address or port, or gone from a relist)
goes to each ``on_removed`` listener: what the sidecar learned of it is forgotten (its
circuit breaker and probe, what it serves). RBAC: get, list and
watch on pods (deploy/base/rbac.yaml). Deliberate limits: one namespace and one selector;
readiness gates and container ports are not read; pods sharing an IP differ by port only.
How the watch converges: docs/extending/design-notes.md#pod-watch
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sidecar.targets.allowlist import Allowlist, IPAddress
from sidecar.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: The port of a selected pod without the port label (the default of
#: docs/driving/handoffs.md#pod-labels).
DEFAULT_POD_PORT = 8000
#: The namespace file a pod's service account mounts.
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_GONE = 410


class WatchExpired(Exception):
    """The resource version the watch resumed from is too old (HTTP 410): relist."""


@dataclass(frozen=True, slots=True)
class PodTarget:
    name: str
    address: IPAddress
    port: int


def pod_target(pod: Mapping[str, Any], port_label: str, default_port: int | None
               ) -> PodTarget | None:
    """The target a pod object (API JSON) stands for, or None when it is not one now."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = str(metadata.get("name") or "")
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    try:
        address = ipaddress.ip_address(str(status.get("podIP") or ""))
    except ValueError:
        return None
    label = (metadata.get("labels") or {}).get(port_label)
    port = default_port
    if label is not None:
        text = str(label)
        if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
            logger.warning("pod %s: label %s=%r is not a port; pod not allowed",
                           name, port_label, label)
            return None
        port = int(text)
    if port is None:
        return None
    return PodTarget(name, address, port)


class PodAllowlist:
    """Allowed prefill targets: the selected pods (kept current) plus a static allowlist."""

    def __init__(self, *, port_label: str, default_port: int | None = None,
                 static: Allowlist | None = None) -> None:
        self._port_label = port_label
        self._default_port = default_port
        self._static = static or Allowlist()
        self._pods: dict[str, PodTarget] = {}
        self._pairs: frozenset[tuple[IPAddress, int]] = frozenset()
        #: Bumped on every change, so callers that remember verdicts know to forget them.
        self.version = 0
        self.synced = asyncio.Event()
        self._removed_listeners: list[Callable[[PodTarget], None]] = []

    def on_removed(self, listener: Callable[[PodTarget], None]) -> None:
        """Call ``listener`` with each target that leaves the set."""
        self._removed_listeners.append(listener)

    def _removed(self, gone: Iterable[PodTarget]) -> None:
        for target in gone:
            for listener in self._removed_listeners:
                listener(target)

    @property
    def targets(self) -> list[PodTarget]:
        return sorted(self._pods.values(), key=lambda t: t.name)

    def _key(self, pod: Mapping[str, Any]) -> str:
        metadata = pod.get("metadata") or {}
        return str(metadata.get("uid") or metadata.get("name") or "")

    def _rebuild(self) -> None:
        # One immutable set swapped in whole: a concurrent allows() sees old or new, not half.
        self._pairs = frozenset((t.address, t.port) for t in self._pods.values())
        self.version += 1

    def replace_all(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """The result of a LIST: the whole pod set."""
        fresh: dict[str, PodTarget] = {}
        for pod in pods:
            target = pod_target(pod, self._port_label, self._default_port)
            if target is not None:
                fresh[self._key(pod)] = target
        old = self._pods
        self._pods = fresh
        self._rebuild()
        gone = [target for target in old.values() if _where(target) not in self._pairs]
        self.synced.set()
        logger.info("prefill pods: %d allowed", len(fresh))
        self._removed(gone)

    def apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        """One WATCH event: ADDED, MODIFIED or DELETED (others are ignored)."""
        key = self._key(pod)
        target = pod_target(pod, self._port_label, self._default_port)
        before = self._pods.get(key)
        if kind == "DELETED" or target is None:
            if self._pods.pop(key, None) is None:
                return
        elif kind in ("ADDED", "MODIFIED"):
            if before == target:
                return
            self._pods[key] = target
        else:
            return
        self._rebuild()
        if before is not None and _where(before) not in self._pairs:
            self._removed([before])

    def allows(self, host: str, addresses: Sequence[IPAddress], port: int) -> bool:
        if self._static.allows(host, addresses, port):
            return True
        pairs = self._pairs
        return bool(addresses) and all(_pod_form(a, port) in pairs for a in addresses)


def _where(target: PodTarget) -> tuple[IPAddress, int]:
    return target.address, target.port


def _pod_form(address: IPAddress, port: int) -> tuple[IPAddress, int]:
    # ::ffff:a.b.c.d reaches the IPv4 pod a.b.c.d.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped, port
    return address, port


class PodSource(Protocol):
    """Where pods come from: the Kubernetes API, or a fake in tests."""

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        """Every selected pod (API JSON) and the list's resource version."""
        ...

    def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        """(event type, pod JSON) from ``resource_version`` on; raises WatchExpired on 410
        (BOOKMARK events: a pod whose metadata holds only the new resource version)."""
        ...


def _resource_version(pod: Mapping[str, Any]) -> str | None:
    value = (pod.get("metadata") or {}).get("resourceVersion")
    return str(value) if value else None


async def watch_pods(allowlist: PodAllowlist, source: PodSource, *,
                     backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
    """Keep ``allowlist`` equal to the selected pods until cancelled."""
    delay = backoff_s
    while True:
        try:
            pods, version = await source.list()
            allowlist.replace_all(pods)
            delay = backoff_s
            while True:
                async for kind, pod in source.watch(version):
                    version = _resource_version(pod) or version
                    allowlist.apply(kind, pod)
                # The server closes watches after a while: resume where it stopped.
        except asyncio.CancelledError:
            raise
        except WatchExpired:
            logger.info("pod watch expired; relisting")
            continue
        except Exception as exc:
            # Keep the last known set: an API outage must not open or close the door.
            logger.warning("pod watch failed (%s); relisting in %.1f s",
                           type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_backoff_s)


def current_namespace(path: Path = NAMESPACE_FILE) -> str:
    """The pod's own namespace, from its service account mount."""
    return path.read_text(encoding="utf-8").strip()


class KubernetesPodSource:
    """Pods from the Kubernetes API (in-cluster config) through kubernetes_asyncio."""

    def __init__(self, namespace: str, selector: str, *, watch_timeout_s: int = 300) -> None:
        self._namespace = namespace
        self._selector = selector
        self._watch_timeout_s = watch_timeout_s
        self._api: Any = None
        self._client: Any = None

    async def open(self) -> None:
        # Optional dependency (extra "k8s"): imported only in Kubernetes mode.
        from kubernetes_asyncio import client, config  # type: ignore[import-not-found,unused-ignore]

        config.load_incluster_config()  # type: ignore[no-untyped-call,unused-ignore]
        self._client = client.ApiClient()
        self._api = client.CoreV1Api(self._client)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        from kubernetes_asyncio.client import ApiException  # type: ignore[import-not-found,unused-ignore]

        try:
            response = await self._api.list_namespaced_pod(
                self._namespace, label_selector=self._selector, _preload_content=False)
            data = await response.json()
        except ApiException as exc:
            raise RuntimeError(f"listing pods failed: HTTP {exc.status}") from None
        return list(data.get("items") or []), str(data["metadata"]["resourceVersion"])

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        from kubernetes_asyncio import watch  # type: ignore[import-not-found,unused-ignore]
        from kubernetes_asyncio.client import ApiException  # type: ignore[import-not-found,unused-ignore]

        stream = watch.Watch()
        try:
            async with stream.stream(
                self._api.list_namespaced_pod, self._namespace,
                label_selector=self._selector, resource_version=resource_version,
                allow_watch_bookmarks=True, timeout_seconds=self._watch_timeout_s,
            ) as events:
                async for event in events:
                    yield str(event["type"]), event["raw_object"]
        except ApiException as exc:
            if exc.status == _GONE:
                raise WatchExpired() from None
            raise
        finally:
            stream.stop()


@contextlib.asynccontextmanager
async def watched_pod_allowlist(
    selector: str, static: Allowlist, *, namespace: str | None = None, port_label: str,
    first_list_timeout_s: float, source: PodSource | None = None,
) -> AsyncIterator[PodAllowlist]:
    """The allowlist of the pods ``selector`` picks (in ``namespace``, default this pod's own)
    at their ``port_label``, watched until the context exits; waits up to ``first_list_timeout_s``
    for the first list, so the first requests are not refused needlessly."""
    allowlist = PodAllowlist(port_label=port_label, default_port=DEFAULT_POD_PORT,
                             static=static)
    owned: KubernetesPodSource | None = None
    if source is None:
        namespace = namespace or current_namespace()
        owned = KubernetesPodSource(namespace, selector)
        await owned.open()
        source = owned
    task = asyncio.ensure_future(watch_pods(allowlist, source))
    try:
        try:
            async with asyncio.timeout(first_list_timeout_s):
                await allowlist.synced.wait()
        except TimeoutError:
            logger.warning("no prefill pod list yet (selector %r): refusing pod targets until "
                           "it arrives", selector)
        yield allowlist
    finally:
        try:
            await cancel_and_wait(task)
        finally:
            if owned is not None:
                await owned.close()
