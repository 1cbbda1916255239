"""`python -m jobgen.cli`: the same as the `jobgen` command."""

from jobgen.cli.main import main

main()
