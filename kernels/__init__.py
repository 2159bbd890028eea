"""pdserve kernels package."""
