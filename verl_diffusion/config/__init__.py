"""Hydra YAML shipped as package data (composed on top of verl's ppo_trainer defaults)."""
