"""An OpenAI-compatible endpoint in front of rlfleet's generation backends (``rlfleet serve``, and the URL an
``agent`` environment's agents talk to): :mod:`.protocol` (the API's shapes), :mod:`.chat` (messages and
tool calls), :mod:`.record` (an agent episode's tokens), :mod:`.engine` (batched sampling, episodes),
:mod:`.server` (HTTP). Nothing is imported here: FastAPI and uvicorn load only where a server starts."""
