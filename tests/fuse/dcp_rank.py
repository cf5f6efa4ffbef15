"""One rank of a torch.distributed.checkpoint save (gloo, CPU), run by
test_many_nodes.py: `python dcp_rank.py RANK WORLD PORT DIR` writes this rank's
tensors into DIR, which is on this rank's own mount of one shared filesystem."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.weight": torch.randn(256, 1024, generator=g),
            f"rank{rank}.bias": torch.randn(1024, generator=g),
            "step": torch.tensor(1234)}


def main() -> None:
    rank, world, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dcp.save(state(rank), checkpoint_id=path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
