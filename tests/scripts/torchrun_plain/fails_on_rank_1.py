"""Rank 1 raises after the group formed; torch's @record writes its error for the launcher."""

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


main()
