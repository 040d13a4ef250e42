"""ferroxmp: an LLM inference server (OpenAI HTTP API, continuous batching, a radix prefix
cache over KV pages) in three kinds of process: frontend, scheduler, gpu_worker, started
and watched by the supervisor. docs/ARCHITECTURE.md maps the packages."""
