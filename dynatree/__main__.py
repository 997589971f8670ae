"""`python -m dynatree ...`: the ``dynatree`` command."""
from .cli import main

main(prog_name="dynatree")
