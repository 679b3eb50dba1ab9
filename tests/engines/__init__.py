"""Tests of proxy/engines/."""
