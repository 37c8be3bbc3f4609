"""Validates request bodies against vLLM's own pydantic request models, in the engine venv.

The sidecar's venv has no vLLM, so this runs one short script with the engine venv's python:
bodies go in on stdin as JSON, one verdict per body comes back on stdout (``null`` when vLLM
accepts the body, else its validation message).

    validate_bodies(env, [("completion", body), ("chat", body)]) -> [None, "1 validation ..."]

Deliberate limits: checks the schema only (types, ranges, vLLM's own validators), not
serving-time checks such as the model name or the prompt length; vLLM accepts unknown
fields (it only warns about them), so a misspelt field passes here too. One call pays the
import of vLLM (several seconds): batch bodies into one call.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from typing import Any, Literal

from real_vllm.harness import EngineEnv

RequestKind = Literal["completion", "chat"]

# Module paths of vLLM 0.32.0.
_SCRIPT = """
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
models = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
verdicts = []
for kind, body in json.load(sys.stdin):
    try:
        models[kind].model_validate(body)
        verdicts.append(None)
    except Exception as exc:
        verdicts.append(str(exc))
sys.stdout.write("\\n" + json.dumps(verdicts) + "\\n")
"""


def validate_bodies(
    env: EngineEnv, items: list[tuple[RequestKind, dict[str, Any]]], timeout: float = 120.0
) -> list[str | None]:
    """One verdict per body: None if vLLM's request model accepts it, else the error text."""
    # Whatever vLLM caches or configures at import stays in a temp dir that is removed.
    with tempfile.TemporaryDirectory(prefix="vllm-schema-") as tmp:
        environ = {
            name: tmp
            for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT")
        }
        environ.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin"})
        proc = subprocess.run(
            [str(env.python), "-c", _SCRIPT],
            input=json.dumps(items),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environ,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"schema check failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    # The last line is ours; vLLM may log to stdout before it.
    verdicts: list[str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
    return verdicts
