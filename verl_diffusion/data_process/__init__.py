"""Prompt sets → verl parquet, shipped with the package: ``python -m verl_diffusion.data_process.<name>`` for
``ocr`` (Flow-GRPO's OCR prompts), ``pickscore`` (a prompt per line), ``geneval`` (GenEval metadata jsonl) and
``shapes`` (the shapes world). ``--help`` on each says its inputs; docs/training.md shows them in a run."""
