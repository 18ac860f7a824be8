"""The control half of verl's rollout-server API that a diffusion server answers with nothing.

verl's server manager and replicas call these on every server it knows; they exist for LLM engines. A diffusion
request is one whole batch sampled with one weights version, so there is nothing in flight to abort or resume,
no KV cache to clear, release or restore, and no engine profiler. The diffusers (colocated and standalone) and
vllm-omni servers share this mixin and implement only ``generate``, ``wake_up``, ``sleep`` and the weight updates.
"""

from __future__ import annotations


class BatchServerControls:
    """No-op control methods of verl's rollout-server API, for servers that sample one whole batch per request."""

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None
