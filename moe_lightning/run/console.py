"""One rank-zero log line for the code below ``training/``, which must not import Lightning (``plan`` and
``tokenize`` read it without Lightning, which takes seconds to import)."""

import logging
import os

# Lightning's console handler sits on "lightning.pytorch": these lines appear where Lightning's own do.
log = logging.getLogger("lightning.pytorch.moe_lightning")


def info(message: str) -> None:
    """Log once per job (rank 0), as Lightning's ``rank_zero_info`` does, without importing Lightning."""
    rank = next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if k in os.environ), "0")
    if rank == "0":
        log.info(message)
