"""Tests of proxy/observe/."""
