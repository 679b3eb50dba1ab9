"""cachewitness: a sidecar reverse proxy that witnesses an inference engine's prefix cache."""

__version__ = "0.1.0"
