"""Ray runtime: the same training loop as `memrl.train.controller`, with rollout workers, data-parallel
trainer workers (one torch.distributed group) and the transfer queue as Ray actors.

Entry point: `memrl.distributed.runtime.run_ray_training(cfg, options, ray_address=None)`.
Ray is an optional dependency (`pip install "memrl[ray]"`); importing this package does not import it.
"""
