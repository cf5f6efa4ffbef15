from .store import MetaStore

__all__ = ["MetaStore"]
