"""tierfs: a tiered POSIX filesystem for ML training nodes (NVMe hot tier + S3)."""

__version__ = "0.1.0"
