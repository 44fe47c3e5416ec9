"""`python -m diag`: the command line (diag.cli)."""

from diag.cli import entry

if __name__ == "__main__":
    entry()
