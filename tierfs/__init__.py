"""tierfs: a tiered POSIX filesystem for ML training nodes (NVMe hot tier + S3)."""

__version__ = "0.1.0"

from .hints import HintingSampler, hint  # noqa: E402  (the public data-loader API)

__all__ = ["HintingSampler", "hint", "__version__"]
