"""kvproto inside serving engines: ``kvproto.integrations.vllm`` is vLLM's KV connector."""
