from .store import HotStore

__all__ = ["HotStore"]
