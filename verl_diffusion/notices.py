"""Targeted filters for third-party log lines that look alarming but report nothing wrong here.

Each filter drops one known message on one named logger; nothing is silenced globally. Installed from
``verl_diffusion.plugin`` (every process, driver and Ray workers).
"""

from __future__ import annotations

import logging
import warnings

# transformers 5 warns once per class when a pipeline module imports an image processor by its old name without
# torchvision (SD3 imports SiglipImageProcessor, other diffusers pipelines CLIPImageProcessor) and falls back to the
# PIL processor. Our pipelines never use those processors, and the PIL backend is the one transformers 4 used.
TORCHVISION_FALLBACK = "requires torchvision (not installed); falling back to"
TRANSFORMERS_IMPORT_LOGGER = "transformers.utils.import_utils"


# torchdata's StatefulDataLoader calls its own deprecated ``set_vital`` when an iterator starts and warns about it
# (a UserWarning from inside torchdata, once per epoch): nothing a user of the trainer can or needs to change.
TORCHDATA_SET_VITAL = r"'set_vital' is deprecated"


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in str(record.msg)


def install_notice_filters() -> None:
    """Idempotent."""
    log = logging.getLogger(TRANSFORMERS_IMPORT_LOGGER)
    if not any(isinstance(f, _DropMessage) and f.fragment == TORCHVISION_FALLBACK for f in log.filters):
        log.addFilter(_DropMessage(TORCHVISION_FALLBACK))
    warnings.filterwarnings("ignore", message=TORCHDATA_SET_VITAL, category=UserWarning,
                            module=r"torchdata\.stateful_dataloader")
