"""The witnesses of a reset: the traffic after it and the canary."""
