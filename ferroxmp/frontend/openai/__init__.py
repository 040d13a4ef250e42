"""OpenAI's dialects: request validation for completions and chat (`schemas`), their
reply shapes (`replies`), the Responses API (`responses`) and embeddings (`embeddings`)."""
