"""The write path of ``Store.append``: admission, facts, the duplicate rule, digests, the route cache."""
