"""python -m reexecpkg OUT_DIR NPROC: start_method="subprocess" from a package run with -m."""

import sys

import onedist as od
from reexecpkg import work, write_result

out_dir, nproc = sys.argv[1], int(sys.argv[2])
with od.Parallel(backend="gloo", nproc_per_node=nproc, start_method="subprocess") as parallel:
    result = parallel.run(lambda local_rank: work(out_dir, local_rank, 7))
write_result(out_dir, {"mode": parallel.mode, "result": result})
