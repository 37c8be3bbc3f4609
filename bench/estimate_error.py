"""Measures ``--prompt-length-source estimate`` against a real tokenizer.

    <engine venv>/bin/python -m bench.estimate_error TOKENIZER_JSON [TEXT_DIR]

Runs where the ``tokenizers`` package is installed (the real-vLLM engine environment, see
tests/real_vllm/setup_env.sh). The prompts are real English prose: the paragraphs (over 80
characters, at most 20 per file) of the license texts in ``TEXT_DIR`` (default
``/usr/share/common-licenses``). For each it compares the sidecar's estimate
(``sidecar.protocol.prompt_length.estimate_tokens``) with the tokenizer's count and prints the
relative error's mean, median, 10th and 90th percentiles, and the median bytes per token.

Deliberate limits: completions prompts only (the chat estimate adds a fixed per-message
amount that depends on the model's template); prose, not code or other languages.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from sidecar.protocol.context import Route
from sidecar.protocol.prompt_length import estimate_tokens


def prompts(text_dir: Path) -> list[str]:
    found: list[str] = []
    for path in sorted(text_dir.iterdir()):
        try:
            raw = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        paragraphs = [p.strip() for p in raw.split("\n\n") if len(p.strip()) > 80]
        found.extend(paragraphs[:20])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer_json", type=Path)
    parser.add_argument("text_dir", type=Path, nargs="?",
                        default=Path("/usr/share/common-licenses"))
    args = parser.parse_args()
    from tokenizers import Tokenizer  # type: ignore[import-not-found, unused-ignore]

    tokenizer = Tokenizer.from_file(str(args.tokenizer_json))
    texts = prompts(args.text_dir)
    errors, bytes_per_token = [], []
    for text in texts:
        real = len(tokenizer.encode(text, add_special_tokens=False).ids)
        estimate = estimate_tokens(Route.COMPLETIONS, {"prompt": text})
        errors.append((estimate - real) / real)
        bytes_per_token.append(len(text.encode()) / real)
    errors.sort()
    print(f"prompts: {len(texts)}, median {statistics.median(len(t.encode()) for t in texts):.0f}"
          f" bytes")
    print(f"relative error of the estimate: mean {statistics.mean(errors):+.1%}, median "
          f"{statistics.median(errors):+.1%}, p10 {errors[len(errors) // 10]:+.1%}, p90 "
          f"{errors[9 * len(errors) // 10]:+.1%}")
    print(f"bytes per token (median): {statistics.median(bytes_per_token):.2f}")


if __name__ == "__main__":
    main()
