"""``llm_service.proto`` (package ``trtllm_lite.v1``) and its generated stubs
(``llm_service_pb2``, ``llm_service_pb2_grpc``; regenerate with ``generate.py``)."""
