"""The worker pool of the trainer: verl's ResourcePoolManager with a check that counts the platform's Ray resource."""

from __future__ import annotations

import ray
from verl.single_controller.ray.base import ResourcePoolManager
from verl.trainer.ppo.utils import Role


class CpuAwareResourcePoolManager(ResourcePoolManager):
    """verl's check counts only GPU/NPU ("Total available GPUs 0"); count the platform's Ray resource."""

    def _check_resource_available(self):
        from verl.utils.device import get_resource_name

        name = get_resource_name()
        avail = sum(info.get(name, 0) for info in ray._private.state.available_resources_per_node().values())
        need = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
        if avail < need:
            raise ValueError(f"Ray has {avail} {name} available but the trainer asks for {need} workers "
                             f"(trainer.nnodes × trainer.n_gpus_per_node); lower trainer.n_gpus_per_node")


def make_resource_pool_manager(config) -> CpuAwareResourcePoolManager:
    spec = {"global_pool": [int(config.trainer.n_gpus_per_node)] * int(config.trainer.nnodes)}
    return CpuAwareResourcePoolManager(resource_pool_spec=spec, mapping={Role.ActorRollout: "global_pool"},
                                       max_colocate_count=1)
