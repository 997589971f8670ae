"""Ray actors hosting one target/draft pair each (installed as ``dynatree.actors``)."""
