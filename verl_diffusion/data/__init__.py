"""Small prompt sets shipped with the package (the CPU demo's train and validation prompts)."""
