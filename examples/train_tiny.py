"""Train a tiny model with a PyTorch DataLoader reading samples from a tierfs mount.

    python examples/train_tiny.py /mnt/tierfs/tiny-ds --epochs 2

Creates a small synthetic dataset under the given directory if it is empty
(256 samples of 16 float32 features + a label), then trains a linear
classifier for a few epochs. The sampler is wrapped in tierfs.HintingSampler,
so each epoch's random order is sent to the daemon, which prefetches the
files ahead of the workers.
"""
from __future__ import annotations

import argparse
import os
import struct

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import tierfs

FEATURES = 16


def make_dataset(root: str, n: int = 256) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(FEATURES, generator=g)
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        x = torch.randn(FEATURES, generator=g)
        y = int((x @ w).item() > 0)
        with open(os.path.join(root, f"sample-{i:05d}.bin"), "wb") as f:
            f.write(struct.pack(f"<{FEATURES}fB", *x.tolist(), y))


class FileDataset(Dataset):
    def __init__(self, root: str):
        self.files = sorted(os.path.join(root, n) for n in os.listdir(root))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        with open(self.files[i], "rb") as f:
            *x, y = struct.unpack(f"<{FEATURES}fB", f.read())
        return torch.tensor(x), torch.tensor(y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="dataset directory inside a tierfs mount")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    if not os.path.isdir(args.root) or not os.listdir(args.root):
        make_dataset(args.root)
    ds = FileDataset(args.root)
    sampler = tierfs.HintingSampler(RandomSampler(ds), ds.files)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=args.workers)
    model = torch.nn.Linear(FEATURES, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for epoch in range(args.epochs):
        correct = total = 0
        for x, y in loader:
            opt.zero_grad()
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            correct += (out.argmax(1) == y).sum().item()
            total += len(y)
        print(f"epoch {epoch}: loss {loss.item():.3f} accuracy {correct / total:.3f}")


if __name__ == "__main__":
    main()
