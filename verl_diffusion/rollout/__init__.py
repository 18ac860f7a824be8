"""Rollout: the diffusers sampling loop (``diffusers_rollout``), verl rollout replicas (colocated ``diffusers_replica``,
``diffusers_standalone``, ``vllm_omni``), the weight-sync backend and the settings read from the config
(``settings``); all step math is ``algos.sde``."""
