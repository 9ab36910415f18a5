"""The server's routes, one small module each; ``serving.app`` assembles them.

Every module runs on the server's event loop and finds what it needs on
``request.app.state`` (``engine``, ``gate``, ``metrics``, ``config``). None computes
anything heavier than JSON translation; the engine is awaited, never waited for.
"""
