"""The gated stand-in engine: see openai/api_server.py."""
