"""`python -m qcal.cli`."""

from qcal.cli import main

main()
