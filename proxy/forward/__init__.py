"""Forwarding: a client's request to the engine and its response back."""
