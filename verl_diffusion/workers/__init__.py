"""verl-facing workers: CPU platform, diffusion engine, per-step loss glue, actor-rollout worker."""
