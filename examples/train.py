"""Example trainer; the code lives in unickpt.examples.train (installed with the package)."""

from unickpt.examples.train import main

if __name__ == "__main__":
    main()
