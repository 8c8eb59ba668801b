"""kvproto: move the KV cache of LLM requests from prefill servers to decode servers."""

__version__ = "0.1.0"
