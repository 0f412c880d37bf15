"""KV cache movement between a context (prefill) server and a generation (decode) server."""
