"""The write path of ``Store.append``: admission, facts, the duplicate rule, digests, route cache, aggregates."""
