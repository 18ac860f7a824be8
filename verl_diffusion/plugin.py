"""Target of the ``verl.plugins`` entry point: importing it registers everything into verl (idempotent).

verl imports this module in every process (driver and Ray workers) and swallows its import errors at
DEBUG level, so ``python -m verl_diffusion.check`` re-runs the import loudly.
"""

from verl_diffusion.notices import install_notice_filters
from verl_diffusion.registry import register_all

install_notice_filters()
register_all()
