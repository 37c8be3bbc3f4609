"""Where a continuation may start: vLLM's detokenizer primed with a prompt that ends inside
a character, against one that ends at a character's boundary (run in the engine's venv).

    ~/.cache/disagg-sidecar/vllm-0.32.0/venv/bin/python tests/real_vllm/probe_join.py

vLLM 0.32 primes each request's ``tokenizers.decoders.DecodeStream`` with the prompt's ids
(``v1/engine/detokenizer.py``). A migrated stream's continuation has the answer's ids so far
in its prompt; this probe cuts a text of multi-byte characters after every token, primes a
stream with the ids before the cut, steps it through the rest, and checks that the text it
writes joins the text before the cut exactly. Printed: how many cuts of each kind joined.

What it showed (2026-12-06, the tiny model's tokenizer, tokenizers 0.23.3): every cut at a
boundary joins exactly; every cut inside a character writes the whole text decoded so far
again at its first complete character (the prefix no longer matches), so a continuation
must start at a boundary (``sidecar.request.migration``: the join).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

#: Two- to four-byte characters (the four-byte ones: FRAKTUR "Unicode", party poppers).
TEXT = ("h\u00e9llo \u4f60\u597d\u4e16\u754c \u2603 "
        "\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 "
        "\u00e9moji \U0001f389\U0001f389 plain words here")


def main() -> int:
    default = Path.home() / ".cache" / "disagg-sidecar" / "vllm-0.32.0"
    root = Path(os.environ.get("DISAGG_VLLM_ENV", str(default)))
    tokenizer = Tokenizer.from_file(str(root / "model-tiny" / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    whole = tokenizer.decode(ids)
    joined = {"boundary": [0, 0], "inside a character": [0, 0]}
    for cut in range(1, len(ids)):
        before = tokenizer.decode(ids[:cut])
        kind = "inside a character" if before.endswith("\ufffd") else "boundary"
        stream = DecodeStream(ids=ids[:cut], skip_special_tokens=True)
        try:
            after = "".join(piece or "" for piece in
                            (stream.step(tokenizer, token) for token in ids[cut:]))
        except Exception:  # an invalid prefix: it does not join either
            after = "\0"
        exact = before.rstrip("\ufffd") + after == whole
        joined[kind][0 if exact else 1] += 1
    for kind, (good, bad) in joined.items():
        print(f"cuts at {kind}: {good} joined exactly, {bad} did not")
    return 0


if __name__ == "__main__":
    sys.exit(main())
