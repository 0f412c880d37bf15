"""pdserve's HTTP tier and control plane.

The orchestrator speaks OpenAI HTTP to clients and routes each request through a context (prefill)
server and then a generation (decode) server, over HTTP only. It never imports torch nor the
engine/executor packages: ``import orchestrator.app`` must stay light.
"""
