"""Ray actors hosting one target/draft pair each (installed as ``dynatree.actors``).

``worker.ShardWorker`` does the work and runs without Ray; ``ray_actor.PairActor`` is the Ray
actor around it (imported lazily so that ``import dynatree`` never needs Ray).
"""
