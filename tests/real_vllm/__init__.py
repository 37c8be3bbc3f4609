"""End-to-end tests and harness for real vLLM engines on CPU (the ``real_vllm`` marker)."""
