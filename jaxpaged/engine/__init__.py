"""The engine: requests in, scheduled steps, outputs out (sync and asyncio)."""
