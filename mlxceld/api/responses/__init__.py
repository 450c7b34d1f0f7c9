"""OpenAI's Responses API over the shared chat path."""
