"""Worker extension mixed into vllm-omni's ``DiffusionWorker`` (``worker_extension_cls``) for our pipelines.

vllm-omni builds its worker class as ``type(..., (extension, DiffusionWorker), {})``, so these methods take
precedence over the worker's own. They route vllm-omni's LoRA API and the full-weight sync to the pipeline:

* ``add_lora`` / ``remove_lora`` / ``list_loras`` (what ``AsyncOmni.add_lora`` etc. reach through the engine):
  vllm-omni's LoRA manager wraps only vLLM ``LinearBase`` layers, and would find none in our diffusers
  transformer; the pipeline applies the LoRA with peft instead, exactly as the trainer does, so the rollout's
  velocities stay bitwise the trainer's.
* ``verl_load_weights`` (driven by ``collective_rpc``): full weights, ``(name, tensor)`` pairs into
  ``pipeline.load_weights``.

Runs only inside vllm-omni's worker processes (GPU); tests check the dispatch on CPU with the real pipeline.
"""

from __future__ import annotations

from typing import Iterable

import torch
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

__all__ = ["VerlDiffusionWorkerExtension"]


class VerlDiffusionWorkerExtension(CustomPipelineWorkerExtension):
    """LoRA and weight-sync entry points of a vllm-omni worker serving a verl-diffusion pipeline."""

    def _verl_pipeline(self):
        pipeline = getattr(self.model_runner, "pipeline", None)
        if pipeline is None or not hasattr(pipeline, "add_lora"):
            raise RuntimeError(f"this vllm-omni worker serves {type(pipeline).__name__}, not a verl-diffusion "
                               "pipeline; start the engine with custom_pipeline_args.pipeline_class = one of "
                               "verl_diffusion.rollout.vllm_omni.pipelines.PIPELINES")
        return pipeline

    def init_lora_manager(self) -> None:
        # The pipeline owns LoRA (peft); vllm-omni's manager would wrap no layer of a diffusers transformer.
        self.lora_manager = None

    def add_lora(self, lora_request) -> bool:
        return bool(self._verl_pipeline().add_lora(lora_request))

    def remove_lora(self, adapter_id: int) -> bool:
        return bool(self._verl_pipeline().remove_lora(adapter_id))

    def list_loras(self) -> list[int]:
        return list(self._verl_pipeline().list_loras())

    def pin_lora(self, adapter_id: int) -> bool:
        return int(adapter_id) in self._verl_pipeline().list_loras()

    def verl_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Full-weight sync: copy every pair into the pipeline; returns how many parameters were loaded."""
        return len(self._verl_pipeline().load_weights(named_tensors))
