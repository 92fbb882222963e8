"""Serving trtllm-lite engines: gRPC (``trtllm_lite.v1.LLMService`` and KServe v2), an
OpenAI-compatible HTTP front end, Prometheus metrics, a Python client and the CLIs.

Importing this package is cheap (no gRPC); import the submodules you need:
``server`` (run a server), ``client`` (:class:`~trtllm_lite.serving.client.LLMClient`),
``params`` (request values -> ``SamplingParams``).
"""
