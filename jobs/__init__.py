"""Job specs and the batch driver (installed as ``dynatree.jobs``)."""
