"""verl-diffusion: RL post-training of flow-matching image models as a verl plugin."""

__version__ = "0.1.0"
