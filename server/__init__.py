"""The OpenAI-compatible HTTP server (Starlette). Not built yet: it arrives with issue 5."""
