"""Tool calling: the request's tools, a forced call's grammar, an answer split into
content, reasoning and calls."""
