"""`edgespec serve`: the OpenAI-compatible HTTP server and web page over a ring (``app``:
``create_app``, ``serve``). Nothing is imported here, so the CLI loads FastAPI only to serve."""
