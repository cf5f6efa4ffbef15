"""An fsspec filesystem for tierfs mounts, protocol "tierfs" (the optional extra
`tierfs[fsspec]`): URLs such as "tierfs:///mnt/tierfs/ckpt/step-1000" name paths on a
mount as this node sees them. Files are opened with tierfs.open (the direct path),
but for appends (the mount's O_APPEND keeps appenders in many processes apart);
everything else (listing, stat, mkdir, rename, delete) goes through the mount, as
fsspec's local filesystem does it. Libraries that take fsspec URLs (PyTorch
Lightning, torch.distributed.checkpoint's FsspecWriter and FsspecReader, Hugging
Face datasets, pandas) then read and write the hot tier directly (files written
inside `fs.transaction` go through the mount: fsspec writes them aside and moves
them in place at its commit):

    import fsspec
    with fsspec.open("tierfs:///mnt/tierfs/ckpt/model.bin", "wb") as f:
        f.write(data)
"""
from __future__ import annotations

from fsspec.implementations.local import LocalFileSystem

from .direct import open as direct_open


class TierFileSystem(LocalFileSystem):
    protocol = "tierfs"
    root_marker = "/"

    def _open(self, path, mode="rb", block_size=None, autocommit=True, **kwargs):
        if not autocommit and "r" not in mode:
            # Written inside fs.transaction: fsspec's own file, written aside and moved
            # in place (through the mount) when the transaction commits, dropped if it
            # fails. Reads stay direct (fsspec commits none).
            return super()._open(path, mode, block_size, autocommit=False, **kwargs)
        path = self._strip_protocol(path)
        if self.auto_mkdir and any(c in mode for c in "wxa"):
            self.makedirs(self._parent(path), exist_ok=True)
        if "a" in mode:  # appends through the mount: O_APPEND keeps many appenders apart
            return super()._open(path, mode, block_size, autocommit=True, **kwargs)
        # fsspec asks for binary modes here (it wraps text modes itself).
        return direct_open(path, mode)

    def unstrip_protocol(self, name: str) -> str:
        return f"tierfs://{self._strip_protocol(name)}"
