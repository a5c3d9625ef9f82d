"""The training layer: what a training loop needs on top of the collectives.

* ``auto.py``: :func:`~onedist.auto_model`, :func:`~onedist.auto_optim`,
  :func:`~onedist.auto_dataloader`, :func:`~onedist.unwrap` (the backend picks the wrapper);
* ``accumulation.py``: :func:`~onedist.no_sync`, :func:`~onedist.accumulate` (gradient
  accumulation, the exchange skipped the way each backend needs);
* ``precision.py``: ``auto_model(precision=...)``'s autocast and GradScaler, :func:`~onedist.backward`;
* ``sharding.py``: ``auto_model(sharding="fsdp")``, FSDP2 over the world's mesh;
* ``clipping.py``: :func:`~onedist.clip_grad_norm_`, for sharded and unsharded models;
* ``samplers.py``: the distributed samplers;
* ``syncbn.py``: onedist's SyncBatchNorm (CPU and any backend), and the conversion;
* ``evaluation.py``: :func:`~onedist.all_gather_eval`, exact distributed evaluation;
* ``checkpoint.py``: :func:`~onedist.save_checkpoint`, :func:`~onedist.load_checkpoint`;
* ``resume.py``: :func:`~onedist.save_training_state`, :func:`~onedist.resume` (step checkpoints).

Nothing below this layer imports it. The modules import nothing at package import time, so
``import onedist`` stays free of torch.
"""
