"""Refuse a commit message whose subject (first line) is over 72 characters: pre-commit's commit-msg hook."""

import sys

LIMIT = 72


def main(path: str) -> int:
    with open(path, encoding="utf-8") as message:
        subject = message.readline().rstrip("\n")
    if len(subject) > LIMIT:
        print(f"commit subject is {len(subject)} characters, at most {LIMIT}: {subject}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
