"""The stub engines' fake tokenizer and deterministic generator (pure functions, no I/O).

Tokenizer: byte level. A text prompt's token ids are its UTF-8 bytes plus ``BYTE_OFFSET``
(ids 3..258, so 0..2 stay free for pad/BOS/EOS like a real vocabulary); a chat request is
first rendered by ``chat_template`` into text. A prompt given as token ids is used as is.

Generator: output token *i* is ``mix(digest(prompt ids), i, kind)``, a pure function of the
prompt token ids and the position, so identical requests give identical outputs on every
stub, in every process. ``kind`` says where the prompt's KV came from:

- ``REMOTE``: a valid hand-off from a prefill engine. Words are lowercase (" kavo").
- ``LOCAL``: the engine computed the prompt itself (no hand-off, or a broken one). Words
  are UPPERCASE (" KAVO") and drawn from another id range, so a broken hand-off is visible
  in the text and in the token ids, never by a chance collision.

A prefill engine's single token is the REMOTE token at position 0, so a correct P->D flow
gives a decode output whose first token equals the prefill's (as with real engines, where
decode continues from the prefill's KV).

Deliberate limits: no real model and no detokenizer for prompts; ``temperature``, ``top_p``
and ``seed`` do not change the output (determinism beats realism for tests). EOS is emitted
only when the stub is configured with ``eos_rate`` (never at position 0).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import StrEnum
from typing import Final

from sidecar import jsonutil

BYTE_OFFSET: Final = 3
EOS_TOKEN_ID: Final = 2
REMOTE_BASE: Final = 1000
LOCAL_BASE: Final = 6000

_CONSONANTS: Final = "bdfgklmnprstvz"
_VOWELS: Final = "aeiou"
_SYLLABLES: Final = [c + v for c in _CONSONANTS for v in _VOWELS]
# 70 * 70 = 4900 two-syllable words; the vocabulary uses the first 4096.
VOCAB_SIZE: Final = 4096
_WORDS: Final = [" " + a + b for a in _SYLLABLES for b in _SYLLABLES][:VOCAB_SIZE]
_WORDS_UPPER: Final = [w.upper() for w in _WORDS]

_MASK64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15
_LOCAL_SALT: Final = 0x5DEECE66D1234567


class PrefillKind(StrEnum):
    """Where the prompt's KV came from, which decides the generated words."""

    REMOTE = "remote"
    LOCAL = "local"


def encode_text(text: str) -> list[int]:
    """Byte-level token ids of ``text``."""
    return [b + BYTE_OFFSET for b in text.encode()]


def chat_template(messages: Sequence[object]) -> str:
    """A trivial chat template: one ``<|role|>`` line per message, then the assistant turn.

    Message content may be a string or a list of parts (``{"type": "text", "text": ...}``);
    other parts are ignored.
    """
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError("each message needs a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                str(p.get("text", ""))
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError("message content must be a string or a list of parts")
        out.append(f"<|{role}|>\n{content}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def prompt_digest(token_ids: Sequence[int]) -> int:
    """A 64-bit digest of the prompt token ids (the identity a hand-off must carry)."""
    return int.from_bytes(
        hashlib.blake2b(jsonutil.dumps(list(token_ids)), digest_size=8).digest(), "big"
    )


def _mix(x: int) -> int:
    # splitmix64 finaliser: cheap, well spread, pure Python.
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_at(digest: int, position: int, kind: PrefillKind) -> int:
    """The (non-EOS) token the stub generates at ``position`` for a prompt digest."""
    salt = _LOCAL_SALT if kind is PrefillKind.LOCAL else 0
    h = _mix(digest ^ salt ^ ((position * _GOLDEN) & _MASK64))
    base = LOCAL_BASE if kind is PrefillKind.LOCAL else REMOTE_BASE
    return base + (h >> 11) % VOCAB_SIZE


def generate(
    digest: int,
    max_tokens: int,
    kind: PrefillKind,
    *,
    eos_rate: int = 0,
    ignore_eos: bool = False,
) -> tuple[list[int], str]:
    """Generate up to ``max_tokens`` tokens; returns (token ids, finish_reason).

    With ``eos_rate`` N > 0 the stub stops with EOS (finish "stop", EOS not included in
    the ids, as engines report it) with probability 1/N per position >= 1, unless
    ``ignore_eos``.
    """
    out: list[int] = []
    for i in range(max_tokens):
        stop = eos_rate > 0 and not ignore_eos and i > 0
        if stop and _mix(digest ^ (i << 1) ^ 1) % eos_rate == 0:
            return out, "stop"
        out.append(token_at(digest, i, kind))
    return out, "length"


def token_text(token_id: int) -> str:
    """The text of one generated token ('' for ids outside the generated ranges)."""
    if REMOTE_BASE <= token_id < REMOTE_BASE + VOCAB_SIZE:
        return _WORDS[token_id - REMOTE_BASE]
    if LOCAL_BASE <= token_id < LOCAL_BASE + VOCAB_SIZE:
        return _WORDS_UPPER[token_id - LOCAL_BASE]
    if BYTE_OFFSET <= token_id < BYTE_OFFSET + 256:
        return chr(token_id - BYTE_OFFSET)
    return ""


def decode_tokens(token_ids: Sequence[int]) -> str:
    """The text of generated tokens."""
    return "".join(token_text(t) for t in token_ids)


def is_local_text(text: str) -> bool:
    """True when ``text`` was generated from a local prefill (uppercase words)."""
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and all(c.isupper() for c in letters)


def is_remote_text(text: str) -> bool:
    """True when ``text`` was generated from a remote (handed-off) prefill."""
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and all(c.islower() for c in letters)


def expected_text(
    prompt_ids: Sequence[int], max_tokens: int, kind: PrefillKind = PrefillKind.REMOTE
) -> str:
    """What a stub answers for these prompt ids (for tests and the demo)."""
    ids, _ = generate(prompt_digest(prompt_ids), max_tokens, kind)
    return decode_tokens(ids)
