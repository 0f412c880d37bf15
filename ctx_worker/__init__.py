"""The context (prefill) role: context_only admission, first token, KV parking under a lease."""
