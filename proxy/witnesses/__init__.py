"""The witnesses of a reset: the traffic after it, the canary, the engine's own KV cache events."""
