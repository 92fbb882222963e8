"""trtllm-lite engines in Triton Inference Server (Python backend, decoupled streaming).

* :mod:`.repository`: ``write_model_repository`` -> ``config.pbtxt`` + ``model.py``
  (``trtllm-lite triton-repo``, :mod:`.cli`).
* :mod:`.model`: ``TritonPythonModel``, what ``model.py`` runs inside the backend stub.
* :mod:`.install`: installs a real ``tritonserver`` and the stub environment
  (``tools/setup_triton.sh``).
* :mod:`.server`: ``TritonServer``, starts that server on a repository (tests, local use).

See docs/triton.md.
"""
