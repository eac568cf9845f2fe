"""Padded sizes: the host pads each step's arrays to a few sizes so that the jitted step and
sampler compile once per size, not once per batch."""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def bucket(n: int) -> int:
    """The smallest of 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times them)
    that holds n: padding costs at most a third of the work, with two shapes per doubling."""
    p = next_power_of_2(n)
    return 0 if n <= 0 else p * 3 // 4 if p >= 4 and n <= p * 3 // 4 else p


def pow2s(lo: int, hi: int) -> list[int]:
    """The powers of two from lo up to hi (both powers of two)."""
    return [1 << i for i in range(lo.bit_length() - 1, hi.bit_length())]


def buckets_upto(n: int) -> list[int]:
    """Every `bucket` value from 1 up to `bucket(n)`."""
    out = [1]
    while out[-1] < n:
        out.append(bucket(out[-1] + 1))
    return out
