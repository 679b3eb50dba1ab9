"""Tests of proxy/cluster/."""
