"""The evidence log: its records, writer, reader and summary."""
