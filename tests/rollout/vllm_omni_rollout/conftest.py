"""Fixture of the vllm-omni tests: a tiny SD3 checkpoint on disk."""

import pytest


@pytest.fixture(scope="module")
def tiny_sd3_path(tmp_path_factory):
    from verl_diffusion.models.tiny import save_tiny_sd3

    return str(save_tiny_sd3(tmp_path_factory.mktemp("vllm_omni") / "sd3"))
