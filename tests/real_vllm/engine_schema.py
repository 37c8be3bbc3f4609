"""Validates request bodies against vLLM's own pydantic request models, in the engine venv.

The sidecar's venv has no vLLM, so a long-lived helper process runs in the engine venv:
it imports vLLM's request models once (several seconds), then answers one JSON line per
body on stdin with one verdict line on stdout (``null`` when vLLM accepts the body, else
vLLM's validation message).

    with VllmSchema(env) as schema:
        schema.validate("completion", body)  -> None | "1 validation error ..."

The ``vllm_schema`` session fixture (conftest.py) holds one for the whole session.

Deliberate limits: checks the schema only (types, ranges, vLLM's own validators), not
serving-time checks such as the model name, ``max_tokens`` against the context, or the prompt
length; vLLM accepts unknown fields (it only warns), so a misspelt field passes here too.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Literal

from real_vllm.harness import EngineEnv

RequestKind = Literal["completion", "chat"]

_VERDICT = "VERDICT "
# Module paths of vLLM 0.32.0. vLLM logs to stdout, so answers carry a prefix.
_SCRIPT = f"""
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
models = {{"completion": CompletionRequest, "chat": ChatCompletionRequest}}
for line in sys.stdin:
    kind, body = json.loads(line)
    try:
        models[kind].model_validate(body)
        verdict = None
    except Exception as exc:
        verdict = str(exc)
    sys.stdout.write({_VERDICT!r} + json.dumps(verdict) + "\\n")
    sys.stdout.flush()
"""


class VllmSchema:
    """A helper process in the engine venv that validates bodies with vLLM's models."""

    def __init__(self, env: EngineEnv) -> None:
        # Whatever vLLM caches or configures at import stays in a temp dir, removed on close.
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-schema-")
        tmp = self._tmp.name
        environ = {
            name: tmp
            for name in ("HOME", "TMPDIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT")
        }
        environ.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin"})
        self._stderr_path = Path(tmp) / "stderr.log"
        with self._stderr_path.open("wb") as stderr:
            self._proc = subprocess.Popen(
                [str(env.python), "-c", _SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=environ,
                text=True,
            )

    def __enter__(self) -> VllmSchema:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def validate(self, kind: RequestKind, body: dict[str, Any]) -> str | None:
        """None if vLLM's request model for ``kind`` accepts ``body``, else the error text."""
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps([kind, body]) + "\n")
        stdin.flush()
        for line in stdout:
            if line.startswith(_VERDICT):
                verdict: str | None = json.loads(line[len(_VERDICT) :])
                return verdict
        raise RuntimeError(
            f"schema helper exited ({self._proc.wait()}):\n"
            f"{self._stderr_path.read_text(errors='replace')[-3000:]}"
        )

    def validate_many(self, items: list[tuple[RequestKind, dict[str, Any]]]) -> list[str | None]:
        return [self.validate(kind, body) for kind, body in items]

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        # Nothing to flush; vLLM's own exit hooks would only cost seconds.
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._tmp.cleanup()


def validate_bodies(
    env: EngineEnv, items: list[tuple[RequestKind, dict[str, Any]]]
) -> list[str | None]:
    """One-shot form: start a helper, validate ``items``, stop it."""
    with VllmSchema(env) as schema:
        return schema.validate_many(items)
