"""The platform choice (verl_diffusion/launch.py: never a silent CPU fallback on a GPU host) and the run artefacts."""

import os

import pytest
import torch

import verl_diffusion.launch as launch
import verl_diffusion.main_flowgrpo as mf
from verl_diffusion.trainer.validation import (
    image_grid, log_images, paired_standard_error, save_before_after, save_reward_curve, validation_gain_line,
    write_validation_scores,
)


def test_cpu_only_host_selects_cpu(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr("verl_diffusion.workers.platform_cpu.accelerator_present", lambda: False)
    monkeypatch.setattr(launch, "_gpu_host", lambda: False)
    try:
        assert launch.select_platform() == "cpu" and os.environ["VERL_PLATFORM"] == "cpu"
    finally:
        os.environ.pop("VERL_PLATFORM", None)


def test_gpu_host_without_cuda_refuses(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr("verl_diffusion.workers.platform_cpu.accelerator_present", lambda: False)
    monkeypatch.setattr(launch, "_gpu_host", lambda: True)
    with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu"):
        launch.select_platform()
    assert "VERL_PLATFORM" not in os.environ


def test_accelerator_or_explicit_choice_is_kept(monkeypatch):
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr("verl_diffusion.workers.platform_cpu.accelerator_present", lambda: True)
    assert launch.select_platform() == "" and "VERL_PLATFORM" not in os.environ
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert launch.select_platform() == "cpu"


def test_pkg_paths_resolve_to_packaged_prompts():
    p = mf.resolve_path("pkg://verl_diffusion/data/tiny_train_prompts.txt")
    assert os.path.isfile(p)


def test_grid_curve_and_before_after(tmp_path):
    imgs = torch.randint(0, 255, (3, 3, 8, 8), dtype=torch.uint8)
    g = image_grid(imgs, cols=3, pad=2)
    assert g.shape == (12, 32, 3)
    assert (g[2:10, 2:10] == imgs[0].permute(1, 2, 0).numpy()).all()
    assert os.path.isfile(save_before_after(imgs, imgs, str(tmp_path / "ba.png"), prompts=["a", "b", "c"]))
    assert os.path.isfile(save_reward_curve([1, 2], [0.1, 0.2], str(tmp_path / "c.png"), val_steps=[2],
                                            val_rewards=[0.3]))


def test_before_after_is_a_small_captioned_sheet(tmp_path):
    """576 images of 96 prompts × 6 repeats, 32 px: 24 distinct prompts spread over the set, each cell the image
    before (left) and after (right) as 128 px thumbnails, a green ✓ / red ✗ verdict under each; the sheet stays
    about a screen wide whatever the validation's size."""
    import numpy as np
    from PIL import Image

    from verl_diffusion.trainer.validation import pick_examples

    n = 576
    prompts = [f"prompt number {i % 96}" for i in range(n)]
    before = torch.randint(0, 255, (n, 3, 32, 32), dtype=torch.uint8)
    after = torch.randint(0, 255, (n, 3, 32, 32), dtype=torch.uint8)
    rows_b = [{"reward": 0.2, "shapes/strict": 0.0} for _ in range(n)]
    rows_a = [{"reward": 0.9, "shapes/strict": 1.0} for _ in range(n)]
    idx = pick_examples(prompts, 24)
    assert len(idx) == 24 and len({prompts[i] for i in idx}) == 24 and idx[0] == 0 and idx[-1] == 95
    a = np.asarray(Image.open(save_before_after(before, after, str(tmp_path / "ba.png"), prompts=prompts,
                                                before_rows=rows_b, after_rows=rows_a)))
    assert a.shape[1] <= 1100 and a.shape[0] <= 1300, a.shape     # (1262, 1090): 6 rows of 4 cells
    # cell k=5 (row 1, col 1): thumbnails are the 32 px images upscaled ×4 (nearest)
    gap, cell_w, thumb, text_h, head = 10, 2 * 128 + 4, 128, 3 * 16 + 18, 28
    x, y = gap + 1 * (cell_w + gap), head + 1 * (thumb + text_h + gap)
    i = idx[5]
    up = lambda t: np.repeat(np.repeat(t.permute(1, 2, 0).numpy(), 4, 0), 4, 1)   # noqa: E731
    assert (a[y:y + thumb, x:x + thumb] == up(before[i])).all()
    assert (a[y:y + thumb, x + thumb + 4:x + 2 * thumb + 4] == up(after[i])).all()
    verdicts = a[y + thumb:y + thumb + 18, x:x + cell_w].reshape(-1, 3).astype(int)
    red = ((verdicts[:, 0] > 150) & (verdicts[:, 1] < 60)).sum()
    green = ((verdicts[:, 1] > 100) & (verdicts[:, 0] < 60)).sum()
    assert red > 10 and green > 10


def test_validation_gain_line():
    """First vs last validation (intermediate ones ignored), reward and each overall strict accuracy with its change."""
    first = {"step": 0, "val/reward_mean": 0.4766, "val/shapes/strict": 0.28125, "val/shapes/mean": 0.4766}
    last = {"step": 40, "val/reward_mean": 0.5990, "val/shapes/strict": 0.36458, "val/shapes/mean": 0.5990}
    assert validation_gain_line([first]) is None
    assert validation_gain_line([first, {"step": 20}, last]) == (
        "validation step 0 -> 40: reward 0.4766 -> 0.5990 (+0.1224) | shapes/strict 0.281 -> 0.365 (+8.3 points)")


def test_validation_gain_line_paired_standard_error():
    """With per-image values in both validations, each change carries sd(after_i − before_i)/sqrt(n): here 4 images,
    strict 0/1/1/0 -> 1/1/1/0 (differences 1, 0, 0, 0: sd 0.5, s.e. 0.25 = 25 points); reward differences 0.2, 0.1,
    0, -0.1 (sd 0.1291, s.e. 0.0645)."""
    first = {"step": 0, "val/reward_mean": 0.5, "val/shapes/strict": 0.5,
             "per_image": {"val/reward_mean": [0.2, 0.9, 0.8, 0.1], "val/shapes/strict": [0, 1, 1, 0]}}
    last = {"step": 20, "val/reward_mean": 0.55, "val/shapes/strict": 0.75,
            "per_image": {"val/reward_mean": [0.4, 1.0, 0.8, 0.0], "val/shapes/strict": [1, 1, 1, 0]}}
    assert paired_standard_error([0, 1, 1, 0], [1, 1, 1, 0]) == pytest.approx(0.25)
    assert paired_standard_error([0.2, 0.9, 0.8, 0.1], [0.4, 1.0, 0.8, 0.0]) == pytest.approx(0.1290994 / 2)
    assert paired_standard_error([1.0], [0.0]) is None and paired_standard_error([1.0, 0.0], [1.0]) is None
    nan = float("nan")   # a failed image's pair is left out
    assert paired_standard_error([0, 1, 1, 0, nan], [1, 1, 1, 0, 1]) == pytest.approx(0.25)
    assert validation_gain_line([first, last]) == (
        "validation step 0 -> 20: reward 0.5000 -> 0.5500 (+0.0500 ± 0.0645) | shapes/strict 0.500 -> 0.750 "
        "(+25.0 ± 25.0 points) (± paired standard error over the 4 validation images)")


def test_validation_scores_file(tmp_path):
    """One JSON line per validation image: prompt, seed, reward and the reward's per-image details (NaN -> null)."""
    import json

    nan = float("nan")
    path = write_validation_scores(str(tmp_path / "v" / "step_00020.jsonl"), ["a circle", "a red square"], [0, 1],
                                   torch.tensor([1.0, 0.25]), {"shapes/strict": torch.tensor([1.0, 0.0]),
                                                               "shapes/strict/colors": torch.tensor([nan, 0.0])})
    rows = [json.loads(line) for line in open(path)]
    assert rows == [{"prompt": "a circle", "seed": 0, "reward": 1.0, "shapes/strict": 1.0,
                     "shapes/strict/colors": None},
                    {"prompt": "a red square", "seed": 1, "reward": 0.25, "shapes/strict": 0.0,
                     "shapes/strict/colors": 0.0}]


def test_reward_curve_draws_the_accuracy_axis(tmp_path):
    import numpy as np
    from PIL import Image

    def green_pixels(path):
        a = np.asarray(Image.open(path).convert("RGB")).astype(int)
        return int((np.abs(a - np.array([44, 160, 44])).sum(-1) < 30).sum())   # matplotlib's tab:green

    plain = save_reward_curve([1, 2, 3], [0.1, 0.2, 0.3], str(tmp_path / "a.png"), val_steps=[0, 3],
                              val_rewards=[0.2, 0.4])
    acc = save_reward_curve([1, 2, 3], [0.1, 0.2, 0.3], str(tmp_path / "b.png"), val_steps=[0, 3],
                            val_rewards=[0.2, 0.4], val_accuracy=[0.25, 0.5])
    assert green_pixels(plain) == 0 and green_pixels(acc) > 50


def test_validation_grid_goes_to_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    class _TB:
        writer = SummaryWriter(str(tmp_path))

    class _Tracker:
        logger = {"tensorboard": _TB(), "console": object()}

    captions = ["a red circle | \u2713 0.93", "a blue square | \u2717 0.41"]
    assert log_images(_Tracker(), "val/images", torch.zeros(2, 3, 8, 8, dtype=torch.uint8), 1,
                      captions=captions) == ["tensorboard"]
    _TB.writer.close()
    assert any(f.startswith("events") for f in os.listdir(tmp_path))
    # the captions went with the images, as text beside the grid
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("val/images/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "0. a red circle | \u2713 0.93" in text and "1. a blue square | \u2717 0.41" in text
