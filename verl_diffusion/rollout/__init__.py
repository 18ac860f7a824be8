"""Rollout backends: the in-worker diffusers loop (``diffusers_rollout``); all step math is ``algos.sde``."""
