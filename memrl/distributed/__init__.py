"""Ray runtime (docs/multinode.md): `memrl.distributed.runtime.run_ray_training(cfg, options)`. Ray is an
optional dependency (`pip install "memrl[ray]"`); importing this package does not import it."""
