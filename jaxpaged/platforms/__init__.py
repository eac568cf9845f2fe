"""The platform jaxpaged runs on (CPU, CUDA GPU): defaults, kernels, batch invariance."""
