"""pdserve engine: paged-KV Llama inference with continuous batching and P/D hand-off.

Import what you use from its submodule (``from engine.llm_engine import LLMEngine``,
``from engine.request import EngineRequest``): this package imports nothing, so the processes that
never run the model (the HTTP frontends) can import the engine's torch-free types (``engine.errors``,
``engine.request``, ``engine.logprobs``, ``engine.sampling_params``) without loading torch
(tests/executor/test_import_graph.py holds that).
"""
