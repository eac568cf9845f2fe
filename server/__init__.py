"""The OpenAI-compatible HTTP server: `jaxpaged serve`, or `build_app(engine, model_name)`."""

from jaxpaged.server.api_server import build_app, run_server

__all__ = ["build_app", "run_server"]
