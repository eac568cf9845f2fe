"""Sampling: the sampler, the rejection sampler, structured outputs."""
