"""Proves ``/metrics`` belongs to whoever serves it: with ``--metrics-port`` the sidecar's
metrics are there and ``/metrics`` on the HTTP port is passed to the engine like any other
path (the engine's own metrics stay reachable); without it the HTTP port serves the
sidecar's.
"""

from __future__ import annotations

import aiohttp
from pd_builders import pd_pair


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            return response.status, await response.text()


async def test_with_a_metrics_port_the_http_port_passes_metrics_to_the_engine() -> None:
    async with pd_pair("vllm", metrics_port=0) as pair:
        status, engine_text = await _get(pair.sidecar.url + "/metrics")
        metrics_url = f"http://127.0.0.1:{pair.sidecar.ports['metrics']}/metrics"
        own_status, own_text = await _get(metrics_url)
    assert status == 200 and "vllm:num_requests_running" in engine_text, engine_text[:300]
    assert "disagg_requests_total" not in engine_text
    assert own_status == 200 and "disagg_requests_total" in own_text
    assert len(pair.decode.recorder.on_path("/metrics")) == 1


async def test_without_one_the_http_port_serves_the_sidecars_metrics() -> None:
    async with pd_pair("vllm") as pair:
        status, text = await _get(pair.sidecar.url + "/metrics")
    assert status == 200 and "disagg_requests_total" in text
    assert pair.decode.recorder.on_path("/metrics") == []
