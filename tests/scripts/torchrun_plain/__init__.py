"""Plain torch.distributed scripts, written for torchrun, that `onedist run` must run unchanged
(tests/test_torchrun_parity.py runs each under both launchers and compares the output)."""
