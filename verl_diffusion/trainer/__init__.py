"""verl's V1 trainers for images (``diffusion_sync``: RayFlowGRPOTrainer, ``diffusion_async``), the prompt dataset,
the run directory and checkpoints, metrics, validation and the graceful stop."""
