"""Tests of proxy/upstream/."""
