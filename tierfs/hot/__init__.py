"""The hot tier: extent files on the node's disk (store.py), and what the clients of
the direct path use of it (pagecache.py). HotStore is imported on first use: a data
loader's process that imports the direct path (which needs only pagecache) does not
load the store, its trash and its copy writers."""

__all__ = ["HotStore"]


def __getattr__(name: str):
    if name == "HotStore":
        from .store import HotStore
        return HotStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
