"""The generation (decode) role: generation_only admission, KV pull, decode."""
