"""The shapes world: a renderer of small scenes of coloured shapes, GenEval-style prompts
with a fixed train / held-out split of their compositions, and a detector that scores an image against a
prompt. Pure numpy; see ``world`` and ``detect``."""

from verl_diffusion.shapes.detect import Detection, ScoreResult, detect, evaluate, satisfies, score
from verl_diffusion.shapes.world import (
    BACKGROUND,
    COLOURS,
    DEFAULT_IMAGE_SIZE,
    RELATIONS,
    SHAPES,
    TAGS,
    ObjectSpec,
    Scene,
    balanced_prompts,
    compositions,
    heldout_prompts,
    make_metadata,
    pretrain_sample,
    render,
    sample_prompt,
    scene_for,
    split_compositions,
    split_of,
)

__all__ = [
    "BACKGROUND", "COLOURS", "DEFAULT_IMAGE_SIZE", "RELATIONS", "SHAPES", "TAGS", "Detection", "ObjectSpec",
    "Scene", "ScoreResult", "balanced_prompts", "compositions", "detect", "evaluate", "heldout_prompts", "make_metadata",
    "pretrain_sample", "render", "sample_prompt", "satisfies", "scene_for", "score", "split_compositions",
    "split_of",
]
