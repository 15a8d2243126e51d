"""``python -m benchmarks``: the side-by-side GPU benchmark (``benchmarks.bench``)."""
from benchmarks.bench import main

if __name__ == "__main__":
    main()
