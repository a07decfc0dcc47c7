"""``longspec serve``: the OpenAI-compatible server over one engine.

``http`` (FastAPI endpoints, limits, errors) over ``server`` (the worker thread that owns the
engine: admission between rounds, streaming), which checks request bodies with ``request``,
tokenises chats with ``tokenizing`` (a piece cache) and changes the engine only through
``engine_calls``."""
