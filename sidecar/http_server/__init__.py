"""The OpenAI HTTP front door (aiohttp): PD routes, the engine passthrough, operations."""
