"""vLLM: kamera's chunk store as a ``KVConnectorBase_V1`` connector (`KameraConnector`).

Load it with ``KVTransferConfig(kv_connector="KameraConnector",
kv_connector_module_path="kamera_agent.engines.vllm.connector", kv_role="kv_both",
kv_connector_extra_config={"config": {...WindowConfig fields...}})``; docs/vllm.md says what is
served and what was verified. The connector is a facade over a scheduler half (`scheduler`) and
a worker half (`worker`). Importing them needs vLLM (the ``vllm`` extra).
"""
