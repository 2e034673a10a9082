"""The byte tokenizer built in, and the optional Hugging Face tokenizer's clear failure modes."""

from __future__ import annotations

import importlib.util

import pytest

from ar_service.tokenizer import ByteTokenizer, HfTokenizer, load_tokenizer
from kvrelay.models.presets import BOS_ID, get_preset


def test_byte_tokenizer_round_trips_utf8():
    tok = load_tokenizer()
    text = "un renard roux — 赤い狐 🦊"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and len(ids) == 1 + len(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size == get_preset("small").ar.vocab


def test_byte_tokenizer_is_stable():
    assert ByteTokenizer().encode("AB") == [BOS_ID, 65, 66]


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_hf_tokenizer_without_the_package_says_what_to_install(tmp_path):
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HfTokenizer(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_hf_tokenizer_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HfTokenizer(tmp_path)
