"""Cluster scope: fan-out to the peers and what they answered."""
