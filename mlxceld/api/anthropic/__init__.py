"""Anthropic's Messages API over the shared chat path."""
