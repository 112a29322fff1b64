"""The OpenAI- and Anthropic-compatible HTTP server (``dflash serve``), one module per job.

- ``requests``: request bodies -> typed, validated dataclasses (the engine's rules, OpenAI's limits)
- ``tools``: function calling: ``tools``/``tool_choice`` checked and rendered, calls parsed out
- ``worker``: the one thread that owns the model, its FIFO queue and the admission limits
- ``metrics``: ``/metrics`` through prometheus_client, one registry per server
- ``scopes``: API keys, and whose earlier text (index, prefix cache) a request may reuse
- ``sharded``: a target sharded over ranks: rank 0 hands each generation to the others
- ``reasoning``: the ``<think>`` split (pure text)
- ``openai_format``: OpenAI's response, chunk and usage shapes
- ``anthropic_format``: Anthropic's Messages API: its bodies in, its blocks and events out
- ``app``: the FastAPI app, SSE streaming, ``create_server`` and ``run``

FastAPI, uvicorn and prometheus_client are imported only when a server is built.
"""

from .app import Server, create_server, follow_server, run

__all__ = ["Server", "create_server", "follow_server", "run"]
