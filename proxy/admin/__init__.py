"""The sidecar's admin side: who may, the route policy, the /cache views."""
