"""The frontend process: HTTP (OpenAI, Anthropic and native dialects), text in and out,
metrics; it talks to the scheduler over ZMQ and imports nothing of the engine."""
