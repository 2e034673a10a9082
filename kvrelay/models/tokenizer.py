"""Tokenizers for the AR stage: a byte-level one built in, or a Hugging Face tokenizer directory.

The byte tokenizer needs no vocabulary file and never touches the network: ids 0..255 are the
UTF-8 bytes of the prompt, then BOS/EOS/PAD (kvrelay.models.presets). A Hugging Face directory
(`tokenizer.json`) is read with the `tokenizers` package, imported only when asked for so the
default install does not need it. Every tokenizer file kvrelay hands a library passes kvrelay's
bound first (kvrelay.limits). Owns text -> ids; never the model or the prompt length policy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from kvrelay.limits import MAX_TOKENIZER_FILE_BYTES, FileRefused, read_bounded_file
from kvrelay.models.presets import BOS_ID, BYTE_TOKENIZER_VOCAB, BYTE_VOCAB, EOS_ID, PAD_ID


def read_tokenizer_json(file: Path) -> str:
    """The text of a `tokenizer.json`, read with kvrelay's bound (`tokenizers` would read any
    file whole, or wait on a pipe forever); FileRefused and ValueError name the file."""
    try:
        data = read_bounded_file(file, MAX_TOKENIZER_FILE_BYTES, "tokenizer.json")
    except FileRefused as err:
        raise FileRefused(f"{file}: {err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not UTF-8 text: {err}") from None


def _tokenizer_json(directory: str | Path) -> Path:
    """`directory`'s tokenizer.json, or `directory` itself when it is no folder; FileNotFoundError
    when there is none (a pipe or a device there is refused by read_tokenizer_json, not missing)."""
    path = Path(directory)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not os.path.lexists(file):
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return file


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the tokenizer's BOS when it has one."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    vocab_size = BYTE_TOKENIZER_VOCAB
    bos_id: int | None = BOS_ID
    eos_id: int | None = EOS_ID
    pad_id = PAD_ID

    def encode(self, text: str) -> list[int]:
        return [BOS_ID, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        # Specials are dropped; a byte sequence cut mid-character decodes with U+FFFD.
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HfTokenizer:
    """A Hugging Face `tokenizer.json` (fast tokenizer); BOS added by its post-processor."""

    def __init__(self, directory: str | Path):
        try:
            from tokenizers import Tokenizer as _HfTokenizer
        except ImportError as exc:
            raise ImportError(
                "a Hugging Face tokenizer directory needs the `tokenizers` package: pip install tokenizers"
            ) from exc
        self._tok = _HfTokenizer.from_str(read_tokenizer_json(_tokenizer_json(directory)))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._special_id(("<|begin_of_text|>", "<s>", "<|endoftext|>"))
        self.eos_id = self._special_id(("<|end_of_text|>", "</s>", "<|im_end|>", "<|endoftext|>"))

    def _special_id(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        return None

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~1.8 s for 1 MiB with
        # the demo's vocabulary), so a caller's thread leaves the event loop free.
        return list(self._tok.encode_batch([text], add_special_tokens=True)[0].ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(path: str | Path | None = None, *, model: Any = None) -> Tokenizer:
    """The byte tokenizer, or the Hugging Face tokenizer at `path` (a directory or tokenizer.json);
    for a BAGEL-format `model` (ModelConfig), BAGEL's prompt wrapping over its tokenizer.json; for
    a checkpoint directory (`model.path`) that holds a tokenizer.json and no `tokenizer` given,
    that one (as vLLM reads it): byte ids would be noise to a model trained on another vocabulary."""
    if model is not None and model.format in ("bagel", "demo"):
        from kvrelay.models.formats import model_dir

        directory = path or model_dir(model)
        if directory is None:
            raise ValueError(f"a {model.format!r} model needs model.path (its tokenizer.json)")
        return BagelTokenizer(directory)
    if path is None and getattr(model, "path", None) and os.path.lexists(Path(model.path) / "tokenizer.json"):
        return HfTokenizer(model.path)
    if path is None:
        return ByteTokenizer()
    return HfTokenizer(path)


class BagelTokenizer:
    """BAGEL's prompt: `<|im_start|>` + the Qwen2 tokens of the text + `<|im_end|>`
    (Bagel.prepare_prompts); the empty prompt (the unconditional CFG row) is those two alone."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as _HfTokenizer

        # Not kvrelay.models.bagel (torch): the AR service builds this before it serves.
        from kvrelay.models.bagel_config import BOS_TOKEN, EOS_TOKEN

        file = _tokenizer_json(directory)
        self._tok = _HfTokenizer.from_str(read_tokenizer_json(file))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        bos, eos = self._tok.token_to_id(BOS_TOKEN), self._tok.token_to_id(EOS_TOKEN)
        if bos is None or eos is None:
            raise ValueError(f"{file}: no {BOS_TOKEN} / {EOS_TOKEN} tokens: not a BAGEL tokenizer")
        self.bos_id: int | None = int(bos)
        self.eos_id: int | None = int(eos)

    def encode(self, text: str) -> list[int]:
        assert self.bos_id is not None and self.eos_id is not None
        # encode_batch: the GIL is released while it works (see HfTokenizer.encode).
        return [self.bos_id, *self._tok.encode_batch([text], add_special_tokens=False)[0].ids, self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))
