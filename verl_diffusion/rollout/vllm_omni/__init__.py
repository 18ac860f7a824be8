"""vllm-omni rollout backend: custom pipelines on our step kernels and a verl rollout replica (docs/vllm_omni.md).

``protocol`` is pure Python; ``pipelines`` and ``worker_extension`` import vllm-omni and load only where it is
installed (``make setup-vllm-omni``); ``replica`` imports it lazily when a server starts.
"""
