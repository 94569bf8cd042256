"""gRPC clients of the forkrl services (deadlines, health waits, retries of UNAVAILABLE only)."""
