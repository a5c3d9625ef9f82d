"""Rank 1 fails right after init; rank 0 is busy outside any collective (python loop or C sleep).

RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment (no launcher that would kill rank 0).
python busy.py python|sleep
"""

import sys
import time

import onedist as od

od.initialize("gloo")
if od.get_rank() == 1:
    time.sleep(0.5)
    raise ValueError("rank 1 failed on purpose")
start = time.time()
if sys.argv[1] == "python":
    while time.time() - start < 60:
        sum(range(1000))
else:
    time.sleep(60)
print("rank 0 ran to the end: nobody stopped it", flush=True)
