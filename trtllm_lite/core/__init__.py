"""The engine core: sequences, the KV block pool, the scheduler and the step loop."""
