"""tierfs: a tiered POSIX filesystem for ML training nodes (NVMe hot tier + S3)."""

__version__ = "0.1.0"

from .hints import HintingSampler, hint  # noqa: E402  (the public data-loader API)
from .direct import open, open_many  # noqa: E402,F401,A001  (tierfs.open: the direct path)
from .accelerate import accelerate  # noqa: E402

# `open` stays out of __all__: `from tierfs import *` must not replace the builtin.
__all__ = ["HintingSampler", "accelerate", "hint", "open_many", "__version__"]

import os as _os  # noqa: E402

if _os.environ.get("TIERFS_ACCELERATE", "").lower() in ("1", "true", "yes", "on"):
    accelerate()
