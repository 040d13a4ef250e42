"""Anthropic's Messages API (`messages`), a thin dialect over the shared chat path."""
