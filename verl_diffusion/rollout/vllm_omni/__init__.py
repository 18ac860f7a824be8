"""vllm-omni rollout backend: custom pipelines on our step kernels and a verl rollout replica (docs/vllm_omni.md).

``protocol`` is pure Python; ``pipelines`` and ``worker_extension`` import vllm-omni and load only where it is
installed (``make setup-vllm-omni``); ``replica`` imports it only when an engine starts.
"""

# diffusers pipeline class of a checkpoint (model_index.json "_class_name") -> our pipeline in ``pipelines``.
PIPELINE_CLASSES = {
    "StableDiffusion3Pipeline": "SD3RolloutPipeline",
}
