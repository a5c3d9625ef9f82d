"""Parallel(start_method="subprocess") with a function that cannot be pickled (tests/test_reexec.py).

python reexec_script.py OUT_DIR NPROC
"""

import sys

from reexecpkg import work, write_result

import onedist as od

if __name__ == "__main__":
    out_dir, nproc = sys.argv[1], int(sys.argv[2])
    offset = 100

    def main(local_rank: int) -> dict:  # a closure defined under __main__: it cannot be pickled
        return work(out_dir, local_rank, offset)

    with od.Parallel(backend="gloo", nproc_per_node=nproc, start_method="subprocess") as parallel:
        result = parallel.run(main)
    write_result(out_dir, {"mode": parallel.mode, "result": result})
