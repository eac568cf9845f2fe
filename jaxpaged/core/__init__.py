"""Scheduling: sequences, the block manager (the KV pool's block tables) and the scheduler."""
