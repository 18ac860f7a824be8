"""Trained weights out of a run, into folders that stock diffusers loads.

* :mod:`.writer`: a transformer state dict (full fine-tune, or LoRA weights in peft's naming) → a diffusers LoRA
  file (``pipe.load_lora_weights(dir)``), a complete pipeline folder (``DiffusionPipeline.from_pretrained(dir)``), or
  a pipeline folder with the LoRA merged; ``export_info.json`` and a README beside the weights.
* :mod:`.shards`: the per-rank FSDP shard files of a checkpoint gathered into one state dict on the CPU.
* ``python -m verl_diffusion.export <run_dir | checkpoints/global_step_k> --output DIR [--merge-lora]``.

Importing this package imports nothing heavy; the workers import :mod:`.writer` to export at every save.
"""
