"""vLLM KV-connector plugins of disagg-sidecar, loaded inside the engine through
``kv_connector_module_path``. vLLM and torch are imported only here, never by ``sidecar``."""
