"""tierfs: a tiered POSIX filesystem for ML training nodes (NVMe hot tier + S3)."""

__version__ = "0.1.0"

from .accelerate import accelerate  # noqa: E402

# The rest of the data-loader API is imported on first use: a data loader's worker
# that imports tierfs for hint() loads no direct path, and the daemon, its guard and
# every command, which import this package too, load only what they use.
_API = {"HintingSampler": "hints", "hint": "hints",
        "open": "direct", "open_many": "direct"}  # tierfs.open: the direct path

# `open` stays out of __all__: `from tierfs import *` must not replace the builtin.
__all__ = ["HintingSampler", "accelerate", "hint", "open_many", "__version__"]


def __getattr__(name: str):
    import importlib
    where = _API.get(name)
    if where is None:  # a submodule (tierfs.direct.MOUNT_BELOW after import tierfs)
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'tierfs' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


import os as _os  # noqa: E402

if _os.environ.get("TIERFS_ACCELERATE", "").lower() in ("1", "true", "yes", "on"):
    accelerate()
