"""KV block pool (MLA), KDA state pool, block hashing and the cache manager that ties them into a prefix cache."""
