"""Which model a stage's `model:` entry names, whatever its format.

Owns the small dispatch every process needs before it builds anything: the checkpoint
directory of a format (the bundled demo's when `format: demo` gives no path) and the KV
geometry it implies, from JSON files only (no torch: config validation runs in the broker
too), and the bound check of the tokenizer files a Hugging Face library reads by path. The
full ModelPreset of a stage is kvrelay.models.stage.stage_preset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrelay.limits import MAX_TOKENIZER_FILE_BYTES, FileRefused, check_bounded_file, read_json_file

# The demo model trained by scripts/train_demo.py, committed beside this module.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
BAGEL_FORMATS = ("bagel", "demo")

# A Hugging Face tokenizer in a model directory: one of these makes it one (fast, SentencePiece,
# BPE/WordPiece vocabularies, Mistral's tekken).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "tekken.json")
# What else `transformers` may read of such a directory to build its tokenizer.
HF_TOKENIZER_SIDE_FILES = (
    "special_tokens_map.json", "added_tokens.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.json", "chat_template.jinja", "config.json",
)  # fmt: skip


def check_tokenizer_files(path: str | Path) -> None:
    """FileRefused naming the file when a tokenizer file at `path` (a directory: each of its files
    a Hugging Face library may read; else the file itself) is no regular file (a pipe, a device:
    a FIFO blocked the AR's start, /dev/zero was read until memory ran out) or holds more than
    MAX_TOKENIZER_FILE_BYTES. Files the directory lacks are the library's to report."""
    directory = Path(path)
    names = HF_TOKENIZER_FILES + HF_TOKENIZER_SIDE_FILES
    files = [directory / name for name in names] if directory.is_dir() else [directory]
    for file in files:
        try:
            check_bounded_file(file, MAX_TOKENIZER_FILE_BYTES, "tokenizer file")
        except FileNotFoundError:
            continue  # not there (or a dangling link): the library's to report
        except FileRefused as err:
            raise FileRefused(f"{file}: {err}") from None


def model_dir(model: Any) -> str | None:
    """The weights directory of a ModelConfig (None: random preset weights)."""
    if model.format == "demo" and not model.path:
        return str(DEMO_DIR)
    return str(model.path) if model.path else None


def bagel_geometry(model: Any) -> tuple[int, int, int, str] | None:
    """(num_layers, num_kv_heads, head_dim, dtype) of a BAGEL-format model from its JSON files
    only (no torch: config validation runs in the broker too); None when the directory is not on
    this machine. Raises ValueError for a directory that is there but unreadable."""
    directory = model_dir(model)
    if directory is None or not Path(directory).is_dir():
        return None
    llm_path = Path(directory) / "llm_config.json"
    if not llm_path.is_file():
        raise ValueError(f"{directory} has no llm_config.json: not a BAGEL checkpoint directory")
    llm = read_json_file(llm_path)
    extra_path = Path(directory) / "kvrelay.json"
    extra = read_json_file(extra_path) if extra_path.is_file() else {}
    try:
        heads = int(llm["num_attention_heads"])
        head_dim = int(llm.get("head_dim") or int(llm["hidden_size"]) // heads)
        layers, kv_heads = int(llm["num_hidden_layers"]), int(llm.get("num_key_value_heads", heads))
        dtype = model.dtype or extra.get("dtype", "bfloat16")
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as err:
        what = f"no {err.args[0]!r}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise ValueError(f"{llm_path} (or kvrelay.json beside it): {what}: not a BAGEL llm_config.json") from None
    return layers, kv_heads, head_dim, str(dtype)


# The Hugging Face families whose decoder is the built-in AR's (RMSNorm, SwiGLU, plain RoPE,
# q/k/v biases for Qwen2). Others with the same tensor names (Gemma: scaled embeddings and
# 1 + weight norms; Qwen3: QK-norm) would load and give another model's KV without an error.
HF_FAMILIES = ("llama", "qwen2", "mistral")


def hf_family_problem(config: Any) -> str | None:
    """Why the built-in AR cannot compute the decoder a config.json describes, or None."""
    if not isinstance(config, dict):
        return "not a JSON object"
    model_type = config.get("model_type")
    if model_type is not None and model_type not in HF_FAMILIES:
        return (
            f"model_type {model_type!r} {config.get('architectures') or []}: the built-in AR computes "
            f"{', '.join(HF_FAMILIES)} decoders only (engine: vllm serves other families)"
        )
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act {act!r}: the built-in AR's MLP is SwiGLU (silu)"
    if config.get("mlp_bias"):
        return "mlp_bias true: the built-in AR's MLP has no biases"
    window = config.get("sliding_window")
    if window and (model_type == "mistral" or config.get("use_sliding_window")):
        return f"sliding_window {window}: the built-in AR attends over the whole prompt (full attention only)"
    return None


def hf_geometry(model: Any, on_cpu: bool) -> tuple[int, int, int, str | None] | None:
    """(num_layers, num_kv_heads, head_dim, dtype) of an AR `{path: DIR}` checkpoint from its
    config.json (the Llama/Qwen2 keys `read_hf_config` reads), its dtype `ar_dtype`'s. None when
    the directory or its config.json is not on this machine (the AR says so at start)."""
    if model.format != "kvrelay" or model.preset is not None or not model.path:
        return None
    path = Path(model.path) / "config.json"
    if not path.is_file():
        return None
    try:
        config = read_json_file(path)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        layers, kv_heads = int(config["num_hidden_layers"]), int(config.get("num_key_value_heads", heads))
    except FileRefused:
        raise  # it names the file and why already
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a Llama/Qwen2 config.json ({type(err).__name__}: {err})") from None
    # The built-in AR computes the Llama family only: another model would load and run (refused
    # here, before any process starts, rather than by the AR after the DiT has loaded).
    problem = hf_family_problem(config) if model.engine == "builtin" else None
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    return layers, kv_heads, head_dim, ar_dtype(model, on_cpu)


def ar_dtype(model: Any, on_cpu: bool) -> str:
    """The dtype an AR `{path: DIR}` checkpoint runs in, on either engine: `model.dtype`, else
    float32 on the CPU and bfloat16 on GPUs. `engine: vllm` is given it too: vLLM's own `auto`
    picks bfloat16 for a float32 checkpoint on CPUs that have it, and the broker then refused the
    AR's registration (GEOMETRY_MISMATCH) after the engine had started beside a float32 DiT."""
    return str(model.dtype or ("float32" if on_cpu else "bfloat16"))
