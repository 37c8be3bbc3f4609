"""Builds a tiny random-weight Mixtral (MoE) next to the suite's tiny Llama, for DP probes.

Runs inside the ENGINE venv: ``python build_moe_model.py LLAMA_DIR OUT_DIR``. It reuses the
Llama's tokenizer files (build_model.py) and saves a 2-layer Mixtral with 4 experts, 2 per
token, in safetensors (1.4 M parameters).

Why: vLLM runs data-parallel ranks of a dense model as independent engines and refuses the
external-load-balancing shapes for them (``Non-MoE models do not support external data
parallel mode``, vllm/engine/arg_utils.py 2415-2424); an MoE model is the only way to start
``--data-parallel-rank`` servers at all.

Deliberate limits: noise with a shape, like the Llama; the same head size (128 / 4 = 32)
the CPU attention backend supports; not built by setup_env.sh (only the probe uses it).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch  # type: ignore[import-not-found, unused-ignore]
from transformers import (  # type: ignore[import-not-found, unused-ignore]
    MixtralConfig,
    MixtralForCausalLM,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def build(llama_dir: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (llama_dir / name).is_file():
            shutil.copy(llama_dir / name, out / name)
    config = MixtralConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2048, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: build_moe_model.py LLAMA_DIR OUT_DIR", file=sys.stderr)
        return 2
    params = build(Path(argv[0]), Path(argv[1]))
    print(f"tiny Mixtral: {params} parameters in {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
