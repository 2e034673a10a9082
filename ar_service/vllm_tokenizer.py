"""The vLLM AR service's tokenizer without torch: vLLM's own tokenizer pipeline, run by the
`tokenizers` library in the service process.

The ids the service reserves pages for and sends to vLLM must be the ids vLLM computes for the
prompt. Loading the directory with transformers' `AutoTokenizer` in the service gives them, but
transformers imports torch on the way (transformers.configuration_utils -> modeling_rope_utils ->
torch: 6.5-10 s and ~300 MB more in every service start on a loaded 2-core VM, docs/ar.md). Rebuilding what `AutoTokenizer` does from the
files (`tokenizer.json` plus tokenizer_config.json) is not exact in general: transformers picks a
class from tokenizer_config.json *and* config.json's model_type, and classes such as
`Qwen2Tokenizer` or `LlamaTokenizer` rebuild the normalizer and pre-tokenizer in Python instead of
reading tokenizer.json's.

So the engine process (which has vLLM, transformers and torch anyway) describes the tokenizer vLLM
itself loaded (`DescribeTokenizer`): its Rust backend serialized as it runs (whatever transformers
rebuilt), when the ids of `encode(text, add_special_tokens=True)` are exactly that backend's
(`TokenizersBackend`, no class on the way overriding the encode path), and vLLM's ids for
PROBE_TEXTS. The service builds the backend with `tokenizers` and uses it only when its ids for
every probe equal vLLM's; otherwise (a slow or Mistral tokenizer, a custom encode, a probe that
differs) it loads `AutoTokenizer` as before (torch in the service), and logs why. The engine side
(`describe_engine_tokenizer`) and the choice (`service_tokenizer`) are in vllm_engine.py; this
module never imports torch, transformers or vLLM (an import-linter contract).
"""

from __future__ import annotations

from dataclasses import dataclass

# Texts whose ids vLLM's tokenizer and the service's must agree on before the service uses its
# own: empty, spaces and newlines, unicode of several scripts and an emoji, text that looks like
# special tokens of common families, and a long one.
PROBE_TEXTS: tuple[str, ...] = (
    "",
    "a",
    " ",
    "  leading and trailing  ",
    "a red fox in the snow, at dusk.",
    "line one\nline two\r\n\ttabbed\n\n",
    "héllo wörld ✓ naïve café",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Здравствуй, мир! مرحبا بالعالم שלום עולם",
    "emoji 🦊🔥👩‍👩‍👧 and ZWJ",
    "<s> </s> <unk> <pad> <|endoftext|> <|im_start|>user<|im_end|> <|begin_of_text|> [INST] [/INST]",
    "<s>text</s><s>",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "code: def f(x):\n    return x ** 2  # square\n",
    "the quick brown fox jumps over the lazy dog " * 40,
)


@dataclass(frozen=True, slots=True)
class DescribeTokenizer:
    """Rank command (vLLM's engine process): describe the tokenizer vLLM loaded -> EngineTokenizer."""


@dataclass(frozen=True, slots=True)
class EngineTokenizer:
    """The tokenizer vLLM loaded, as the service needs it."""

    class_name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    # vLLM's ids of each of PROBE_TEXTS (with special tokens, as a completion prompt).
    probe_ids: tuple[tuple[int, ...], ...]
    # The Rust backend serialized as it runs (tokenizers' to_str), or None with the reason.
    backend_json: str | None
    reason: str = ""
    split_special_tokens: bool = False


class BackendTokenizer:
    """vLLM's tokenizer pipeline run by `tokenizers` (no torch): ids as transformers' `encode(text,
    add_special_tokens=True)` computes them with its defaults (no truncation, no padding), from the
    backend the engine process serialized."""

    def __init__(self, engine: EngineTokenizer) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        assert engine.backend_json is not None
        self._tok = _Tokenizer.from_str(engine.backend_json)
        # transformers' encode disables both unless asked (set_truncation_and_padding); a
        # tokenizer.json may carry either.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = engine.split_special_tokens
        self.vocab_size = engine.vocab_size
        self.bos_id: int | None = engine.bos_id
        self.eos_id: int | None = engine.eos_id

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (see kvrelay.models.tokenizer.HfTokenizer).
        return list(self._tok.encode_batch([text], add_special_tokens=True)[0].ids)

    def decode(self, ids: list[int]) -> str:
        # The backend's decode, without transformers' optional clean-up of spaces; the service
        # never decodes (Tokenize and Prefill send ids).
        return str(self._tok.decode(ids, skip_special_tokens=True))


def torch_free_problem(engine: EngineTokenizer) -> str | None:
    """Why the service cannot compute vLLM's ids without transformers, or None: the backend's ids
    for every probe text must be vLLM's."""
    if engine.backend_json is None:
        return engine.reason
    ours = BackendTokenizer(engine)
    for text, theirs in zip(PROBE_TEXTS, engine.probe_ids, strict=True):
        mine = tuple(ours.encode(text))
        if mine != theirs:
            return (
                f"{engine.class_name}'s Rust backend gives other ids than vLLM for {text[:40]!r}: "
                f"{list(mine[:8])}... != {list(theirs[:8])}..."
            )
    return None
