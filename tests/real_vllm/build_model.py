"""Builds the tiny random-weight Llama model the real-vLLM suite serves, without any hub.

Runs inside the ENGINE venv (it needs torch, transformers and tokenizers), called by
setup_env.sh: ``python build_model.py OUT_DIR``.

What it makes: a byte-level BPE tokenizer (2048 tokens) trained on the Python standard
library's own sources, saved as a ``PreTrainedTokenizerFast`` with a trivial chat template,
and a 2-layer Llama (0.8 M parameters) with seeded random weights in safetensors.

Deliberate limits: the model is noise with a shape; it exists to exercise the serving and
KV-transfer paths, never to say anything meaningful. The head size (128 / 4 = 32) is one the
CPU attention backend supports, and the large initializer range keeps greedy choices away
from near-ties, so every instance produces the same greedy output.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch  # type: ignore[import-not-found, unused-ignore]
from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)
from transformers import (  # type: ignore[import-not-found, unused-ignore]
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: LlamaConfig's bos/eos defaults
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus() -> list[str]:
    """The top-level modules of the standard library, in a stable order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(lib.glob("*.py"))]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        initializer_range=0.2,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: build_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(out)
    build_model().save_pretrained(out, safe_serialization=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
