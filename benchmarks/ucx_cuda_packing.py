"""ucx with CUDA memory at both ends: ``kvferry bench transfer --transport ucx --device cuda`` run with other
``zero_copy_bytes`` / ``pack_bytes`` for the writer (fragments shorter than ``zero_copy_bytes`` are gathered on the
device into messages of up to ``pack_bytes`` and scattered by the receiver). Usage:
``python benchmarks/ucx_cuda_packing.py ZERO_COPY PACK [bench options...]`` (sizes as 16MiB)."""

from __future__ import annotations

import sys
from typing import Any

from kvferry.commands.layout import parse_bytes
from kvferry.transports import ucx


def main() -> int:
    zero_copy, pack = parse_bytes(sys.argv[1]), parse_bytes(sys.argv[2])
    original = ucx.UcxTransport.__init__

    def init(self: ucx.UcxTransport, **options: Any) -> None:
        options.setdefault("zero_copy_bytes", zero_copy)
        options.setdefault("pack_bytes", pack)
        original(self, **options)

    ucx.UcxTransport.__init__ = init  # type: ignore[method-assign]
    from kvferry.cli import main as cli

    return cli(["bench", "transfer", "--transport", "ucx", *sys.argv[3:]])


if __name__ == "__main__":
    sys.exit(main())
