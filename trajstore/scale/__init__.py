"""Scaling out: materializer shards as Ray actors (``ray_actors``).

An edge: the core never imports ray.
"""

__all__: list[str] = []
