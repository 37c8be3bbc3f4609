"""Text of the command line's help that names engines (the example at the end of ``serve
--help`` and ``config --help``), kept in the tools wing with the other engine-naming tools."""

from __future__ import annotations

from typing import Final

SETTINGS_EPILOG: Final = """\
precedence: flag > environment DISAGG_* > the pod's label or annotation > default;
`disagg-sidecar config [the same flags]` prints what they resolve to, with sources.

example: a decode-side sidecar in front of a vLLM engine on port 8000 (NixlConnector), whose
prefill legs may go to engines on port 8000 anywhere in 10.0.0.0/8:
  disagg-sidecar serve --engine vllm --kv-connector NixlConnector --role decode \\
    --engine-url http://127.0.0.1:8000 --prefill-allowlist 10.0.0.0/8:8000
in a Kubernetes pod the labels say the rest:
  disagg-sidecar serve --podinfo-dir /etc/podinfo

every setting: docs/operating/configuration.md
"""
