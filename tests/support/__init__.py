"""Test helpers: servers, clients, engines and parsers the tests share (no test lives here)."""
