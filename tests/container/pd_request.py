"""Sends one prefill/decode request to a sidecar running in a container, from the host.

    host --HTTP--> published port --> sidecar (container) --prefill leg--> stub prefill engine
                                                          --decode leg---> stub decode engine

Waits (bounded) for the sidecar's /ready and any ``--wait`` URL (the prefill stub), sends a
non-streamed ``/v1/completions`` naming the prefill engine in ``x-prefiller-host-port``,
checks the answer is an OpenAI completion made from a remote hand-off, sends the same request
without the header and checks the decode engine then computed the prompt itself, and checks
/health and /metrics answer on the same port; with ``--forbidden``, that a prefill target
off the sidecar's allowlist is refused with 403. Exit status 0 on success, 1 with a message
otherwise. Standard library only, so it runs with any host Python.

The stub engines' text says where the prompt's KV came from (sidecar/tools/stubs/textgen.py):
lowercase words after a valid hand-off from a prefill engine, UPPERCASE words when the decode
engine prefilled locally. So the text alone tells a real PD flow from a silent fallback.

Deliberate limits: one request; it proves the image serves a PD flow through a published port,
not the flow's details (tests/e2e covers those in-process). Proxies are ignored: the target is
on loopback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_ready(url: str, deadline_s: float) -> None:
    """Poll ``url`` until 200: the container needs a moment to start its three processes."""
    end = time.monotonic() + deadline_s
    last = "no answer"
    while time.monotonic() < end:
        try:
            status, body = get(url, timeout=2.0)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            last = repr(exc)
        else:
            if status == 200:
                return
            last = f"{status} {body[:200]!r}"
        time.sleep(0.2)
    raise SystemExit(f"FAIL: {url} not 200 within {deadline_s:.0f} s (last: {last})")


def letters_case(text: str) -> str:
    """ "lower" or "upper" when every letter of ``text`` is, else "mixed"."""
    letters = [c for c in text if c.isalpha()]
    if letters and all(c.islower() for c in letters):
        return "lower"
    if letters and all(c.isupper() for c in letters):
        return "upper"
    return "mixed"


def post_completion(base: str, prefiller: str | None, request_id: str) -> tuple[int, bytes]:
    """Status and body of one completion request; ``prefiller`` None sends no PD header."""
    body = {"model": "stub", "prompt": "The capital of France is", "max_tokens": 8}
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if prefiller is not None:
        headers["x-prefiller-host-port"] = prefiller
    request = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with _OPENER.open(request, timeout=30.0) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def completion(base: str, prefiller: str | None, request_id: str) -> str:
    """The text of one successful completion; anything else exits with a message."""
    status, raw = post_completion(base, prefiller, request_id)
    if status != 200:
        raise SystemExit(f"FAIL: PD completion answered {status}: {raw[:500]!r}")
    doc: dict[str, Any] = json.loads(raw)
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0].get("text"), str):
        raise SystemExit(f"FAIL: not an OpenAI completion: {raw[:500]!r}")
    text: str = choices[0]["text"]
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="http://HOST:PORT of the sidecar")
    parser.add_argument("--prefiller", required=True, help="prefill engine host:port")
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument(
        "--wait", action="append", default=[], metavar="URL", help="also wait for URL to be 200"
    )
    parser.add_argument(
        "--forbidden", metavar="HOST:PORT", help="a prefill target the sidecar must refuse (403)"
    )
    args = parser.parse_args()
    base = args.base.rstrip("/")
    for url in [base + "/ready", *args.wait]:
        wait_ready(url, args.ready_timeout)
    pd_text = completion(base, args.prefiller, "container-smoke-pd")
    print(f"PD completion: {json.dumps(pd_text)}")
    if letters_case(pd_text) != "lower":
        raise SystemExit(f"FAIL: the PD answer was not made from a hand-off: {pd_text!r}")
    local_text = completion(base, None, "container-smoke-local")
    print(f"local completion: {json.dumps(local_text)}")
    if letters_case(local_text) != "upper":
        raise SystemExit(
            f"FAIL: without the header the decode engine should prefill: {local_text!r}"
        )
    if args.forbidden:
        status, raw = post_completion(base, args.forbidden, "container-smoke-forbidden")
        if status != 403:
            raise SystemExit(f"FAIL: off-allowlist target answered {status}: {raw[:300]!r}")
        print(f"off-allowlist prefill target {args.forbidden}: 403")
    for path in ("/health", "/metrics"):
        status, body = get(base + path)
        if status != 200:
            raise SystemExit(f"FAIL: {path} answered {status}: {body[:200]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
