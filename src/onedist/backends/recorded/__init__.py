"""Process groups whose every call is on record: numbered, signed and compared across ranks.

:mod:`.calls` keeps one group's calls on one rank, :mod:`.gloo` is onedist's gloo group (torch's
``ProcessGroupGloo`` inside a recording Python group), :mod:`.steps` gives DDP's gradient buckets
their step. The failure watcher reads the logs (:mod:`onedist.failures.stall`,
:mod:`onedist.failures.history`); shm and mpi4py, onedist's own Python groups, keep a log too.
"""
