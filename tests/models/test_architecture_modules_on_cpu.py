"""An architecture is one module of verl_diffusion/models: every table (adapters by name and by pipeline class, tiny
builders, the vllm-omni pipelines) is derived from the modules that name an ``ADAPTER``."""

import sys
import textwrap

import pytest

import verl_diffusion.models as models
from verl_diffusion.models.base import DiffusersAdapter
from verl_diffusion.models.tiny import TINY_BUILDERS
from verl_diffusion.rollout.vllm_omni import PIPELINE_CLASSES, rollout_pipeline_name


def test_every_table_is_derived_from_the_architecture_modules():
    modules = models.architecture_modules()
    assert sorted(modules) == ["flux", "flux2_klein", "qwen_image", "sd3"]
    for name, module in modules.items():
        adapter = module.ADAPTER
        assert issubclass(adapter, DiffusersAdapter) and adapter.name == name
        assert adapter.architecture.endswith("Pipeline") and adapter.transformer_class.endswith("Model")
        assert models.get_adapter_cls(name) is adapter
        assert models.MODEL_ADAPTERS[name] == f"{adapter.__module__}:{adapter.__name__}"
        assert models.PIPELINE_ARCHITECTURES[adapter.architecture] == name
        assert TINY_BUILDERS[name] is module.build_tiny_pipeline
        assert PIPELINE_CLASSES[adapter.architecture] == rollout_pipeline_name(adapter)
    assert PIPELINE_CLASSES["StableDiffusion3Pipeline"] == "SD3RolloutPipeline"
    assert len(set(PIPELINE_CLASSES.values())) == len(modules)


def test_a_new_file_is_a_new_architecture(tmp_path, monkeypatch):
    """A module dropped into the package's path with an ADAPTER is found by name and by pipeline class."""
    (tmp_path / "toy_arch.py").write_text(textwrap.dedent('''
        from verl_diffusion.models.base import DiffusersAdapter

        class ToyAdapter(DiffusersAdapter):
            name = "toy"
            architecture = "ToyPipeline"
            transformer_class = "ToyTransformer2DModel"

            @staticmethod
            def latent_grid(transformer_config, vae_config, height, width):
                return 8, (4, height // 8, width // 8)

        ADAPTER = ToyAdapter

        def build_tiny_pipeline(**kwargs):
            raise NotImplementedError
    '''))
    (tmp_path / "model_index.json").write_text('{"_class_name": "ToyPipeline"}')
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    models.architecture_modules.cache_clear()
    try:
        cls = models.get_adapter_cls("toy")
        assert cls.__name__ == "ToyAdapter" and models.PIPELINE_ARCHITECTURES["ToyPipeline"] == "toy"
        assert models.architecture_of(tmp_path) == "toy" and models.adapter_for_path(tmp_path) is cls
        assert rollout_pipeline_name(cls) == "ToyRolloutPipeline"
    finally:
        monkeypatch.undo()
        monkeypatch.delitem(sys.modules, "verl_diffusion.models.toy_arch", raising=False)
        models.architecture_modules.cache_clear()
    with pytest.raises(KeyError, match="unknown; choose one of"):
        models.get_adapter_cls("toy")
