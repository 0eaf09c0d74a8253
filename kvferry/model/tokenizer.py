"""Text <-> token ids for ``kvferry generate``.

The ``tiny`` reference model has a 256-token vocabulary: :class:`ByteTokenizer` maps UTF-8 bytes to ids one to
one. A checkpoint directory brings its own tokenizer when it has one (``tokenizer.json`` through the
``tokenizers`` library, else transformers' ``AutoTokenizer`` from the local files only); without one, only
token ids can be given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from attrs import frozen

from kvferry.errors import ConfigError

__all__ = ["ByteTokenizer", "HfTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@frozen
class ByteTokenizer:
    """UTF-8 bytes as token ids (``vocab_size`` 256); undecodable byte runs decode as U+FFFD."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


@frozen
class HfTokenizer:
    """A checkpoint's own tokenizer (a ``tokenizers.Tokenizer`` or a transformers tokenizer)."""

    backend: Any

    def encode(self, text: str) -> list[int]:
        encoded = self.backend.encode(text)
        ids = encoded.ids if hasattr(encoded, "ids") else encoded
        return [int(t) for t in ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.backend.decode(list(token_ids)))


def load_tokenizer(model: str | Path) -> Tokenizer | None:
    """The tokenizer for ``model``: bytes for ``tiny`` and ``tiny-kimi``, the directory's own if it has one, else
    None.

    :raises ~kvferry.errors.ConfigError: when the directory has tokenizer files that cannot be loaded.
    """
    if str(model) in ("tiny", "tiny-kimi"):  # byte-level vocabularies of 256
        return ByteTokenizer()
    path = Path(model)
    if (path / "tokenizer.json").is_file():
        try:
            import tokenizers

            return HfTokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")))
        except ImportError:
            pass
        except Exception as exc:
            raise ConfigError(f"cannot load {path / 'tokenizer.json'}: {exc}") from None
    if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        try:
            return HfTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        except Exception as exc:
            raise ConfigError(f"cannot load the tokenizer in {path}: {exc}") from None
    return None
