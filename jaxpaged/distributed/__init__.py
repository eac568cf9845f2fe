"""Several devices and processes: the mesh, `jax.distributed`, the multi-process engine."""
