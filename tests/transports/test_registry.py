"""Transports by name (``kvferry.transports.registry``): nothing imports a library until its transport is asked
for, and a missing one names its extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvferry.errors import MissingExtraError
from kvferry.transports import get_transport


def test_importing_kvferry_imports_no_library() -> None:
    code = textwrap.dedent(
        """
        import sys, kvferry, kvferry.transports, kvferry.transports.base, kvferry.transports.messages, kvferry.wire
        from kvferry.transports import get_transport
        get_transport("local")
        loaded = [m for m in ("nixl", "nixl_cu13", "nixl_cu12", "ucxx") if m in sys.modules]
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_library_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["nixl_cu13"] = None  # as if not installed
        sys.modules["ucxx"] = None
        from kvferry.errors import MissingExtraError
        from kvferry.transports import get_transport, available_transports
        for name, extra in (("nixl", "nixl"), ("ucx", "ucx")):
            try:
                get_transport(name)
            except MissingExtraError as exc:
                assert exc.extra == extra and f"kvferry[{extra}]" in str(exc), exc
            else:
                raise AssertionError(name)
        assert available_transports()["local"] is None
        assert type(get_transport("auto")()).__name__ == "LocalTransport"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(LookupError):
        get_transport("carrier-pigeon")
    assert issubclass(MissingExtraError, ImportError)
