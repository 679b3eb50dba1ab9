"""Tests of proxy/sim/."""
