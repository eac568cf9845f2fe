"""Speculative decoding: its config, the proposers, and their registry."""
