"""`/cache/reset`: the reset service, its retries, parameters and answers."""
