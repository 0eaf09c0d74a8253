"""python -m kvferry == the kvferry console script."""

from kvferry.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
