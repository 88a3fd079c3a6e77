"""KV block pool (MLA), KDA state pool, block hashing, the block and state managers over the pools, and the cache
manager that coordinates them into a prefix cache."""
