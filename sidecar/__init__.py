"""disagg-sidecar: prefill/decode-disaggregated LLM serving next to any engine.

The sidecar runs beside one engine (vLLM, SGLang, TensorRT-LLM) in a Kubernetes pod. It takes
generic router contracts (OpenAI HTTP with an ``x-prefiller-host-port`` target, and the gRPC
services ``disagg.PrefillWorker`` / ``disagg.DecodeWorker``) and translates them into the
engine's own hand-off dialect.
"""

__version__ = "0.1.0"
