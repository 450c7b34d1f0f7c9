"""The control API's clients: the typed asyncio one and mlxctl's blocking one, over one IO-
free exchange."""
