"""Offline makers of a tiny Hugging Face causal LM, its tokenizer and instruction data.

Tests, examples and the fine-tune of docs/hf.md need a real model folder (config, sharded
safetensors, tokenizer with a chat template) and real instruction text, on machines
that must never download from a model hub. Everything here is built from the Python
standard library's own sources, which every machine has: a byte-level BPE trained on
them, a randomly initialised Llama / Qwen2 / Mistral, and question/answer pairs made
from the library's docstrings (parsed with `ast`, never imported). Same Python, same
seed → same bytes.

    python -m raytrain_platform.tools.tiny_llm /tmp/tiny --arch qwen2 --samples 500

``--samples`` is at most the number of docstrings the standard library holds (5,556
with Python 3.11 here); more is refused before anything is written.

>>> import tempfile
>>> paths = make_all(tempfile.mkdtemp(), samples=50)  # doctest: +SKIP
>>> sorted(paths)  # doctest: +SKIP
['chat', 'model', 'preference', 'preference_chat', 'prompt_completion', 'text', 'tokenizer']
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping

from raytrain_platform.errors import PATH_ERRNOS, ConfigError, OneLineParser, UserError, folder_problem
from raytrain_platform.tools.preference_data import write_preference_jsonl

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "EOS_TOKEN",
    "IM_START",
    "IM_END",
    "CHAT_TEMPLATE",
    "ARCHS",
    "make_tokenizer",
    "make_model",
    "make_instruction_jsonl",
    "make_all",
    "main",
]

EOS_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML: each message is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation
# prompt opens an assistant turn, so a prefix render is a string prefix of the full one.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHS = ("llama", "qwen2", "mistral")
_TOKENIZER_BYTES = 1_000_000  # enough text for a 512-token BPE, trains in ~1-2 s
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
              "test_json", "turtledemo"}


# ---------------------------------------------------------------- standard library text


def _stdlib_sources() -> list[Path]:
    """Every .py file of the standard library (no tests, no site-packages), sorted by
    path relative to the library root so the order is the same on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _tokenizer_corpus() -> Iterator[str]:
    """The first ~1 MB of top-level stdlib modules, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        total += len(text)
        if total >= _TOKENIZER_BYTES:
            return


def _module_name(path: Path) -> str:
    rel = path.relative_to(sysconfig.get_paths()["stdlib"]).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _first_paragraph(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines()).strip()


def _docstrings(tree: ast.Module, prefix: str) -> Iterator[tuple[str, str]]:
    """(qualified name, first docstring paragraph) of public classes, functions and
    methods, in source order; nested functions are skipped (not addressable)."""
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_"):
            continue
        qualname = f"{prefix}.{node.name}"
        doc = ast.get_docstring(node)
        if doc and len(para := _first_paragraph(doc)) >= 10:
            yield qualname, para
        if isinstance(node, ast.ClassDef):
            yield from _docstrings(node, qualname)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=4)
def _qa_pairs(n: int) -> tuple[tuple[str, str], ...]:
    """The first `n` (question, answer) pairs from stdlib docstrings, in sorted file order;
    ConfigError if this machine's standard library holds fewer."""
    pairs: list[tuple[str, str]] = []
    for path in _stdlib_sources():
        if any(part.startswith("_") for part in _module_name(path).split(".")):
            continue  # private modules make odd questions
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):  # a few stdlib files are deliberately invalid
            continue
        for qualname, answer in _docstrings(tree, _module_name(path)):
            pairs.append((f"What does `{qualname}` do?", answer))
            if len(pairs) == n:
                return tuple(pairs)
    raise ConfigError("samples", n, f"at most {len(pairs)}: the docstrings this machine's standard "
                      "library holds")


# ---------------------------------------------------------------- tokenizer


def make_tokenizer(out_dir: str | Path, *, vocab_size: int = 512) -> "PreTrainedTokenizerFast":
    """Train a byte-level BPE on stdlib sources and save it, with a ChatML chat template,
    to `out_dir` (loadable by ``AutoTokenizer.from_pretrained(out_dir, local_files_only=True)``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if not (isinstance(vocab_size, int) and vocab_size >= 300):
        raise ConfigError("vocab_size", vocab_size, "an integer >= 300 (256 bytes + specials + merges)")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # Untrimmed offsets: a token's span is exactly the characters it encodes, which the
    # loss masks of chat data rely on.
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS_TOKEN, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                  additional_special_tokens=[IM_START, IM_END])
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 1 << 30  # no spurious "sequence too long" warnings
    tok.save_pretrained(str(out_dir))
    return tok


# ---------------------------------------------------------------- model


def _model_config(arch: str, **kw):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    return cls(tie_word_embeddings=False, **kw)


def _check_model_args(*, arch: str = "llama", hidden_size: int = 64, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                      max_position_embeddings: int = 256, dtype: str = "float32",
                      max_shard_size: str | None = None, names: Mapping[str, str] | None = None,
                      **_: object) -> None:
    """ConfigError for a bad model shape, before anything is written (defaults mirror
    `make_model`'s). `names` maps a parameter to the name the message gives it (the
    CLI's flags); by default the parameter's own name."""
    def n(field: str) -> str:
        return (names or {}).get(field, field)

    if arch not in ARCHS:
        raise ConfigError(n("arch"), arch, f"one of {', '.join(ARCHS)}")
    for field, value in (("hidden_size", hidden_size), ("num_layers", num_layers),
                         ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                         ("intermediate_size", intermediate_size),
                         ("max_position_embeddings", max_position_embeddings)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(n(field), value, "an integer >= 1")
    if hidden_size % num_heads:
        raise ConfigError(n("num_heads"), num_heads, f"a divisor of {n('hidden_size')} ({hidden_size})")
    if num_heads % num_kv_heads:
        raise ConfigError(n("num_kv_heads"), num_kv_heads, f"a divisor of {n('num_heads')} ({num_heads})")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(n("dtype"), dtype, "one of float32, bfloat16, float16")
    if max_shard_size is not None and not re.fullmatch(r"\d+(KB|MB|GB|KiB|MiB|GiB)", str(max_shard_size)):
        raise ConfigError(n("max_shard_size"), max_shard_size, "a size like 200KB, 5MB or 1GiB")


def _check_out(out: Path, name: str) -> None:
    """ConfigError unless `out` can hold model/ and data/ folders: no file in their way,
    and this user may write where they go (checked before anything is written)."""
    where = out.absolute()
    for path in (where, where / "model", where / "data"):
        problem = folder_problem(path)
        if problem is not None:
            raise ConfigError(name, str(out), f"a folder that can be created and written ({problem})")


def _save_kwargs(model, max_shard_size: str | None) -> dict:
    kw: dict = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    # transformers 4 needs safe_serialization=True; 5 always writes safetensors and
    # dropped the argument.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kw["safe_serialization"] = True
    return kw


def make_model(out_dir: str | Path, *, arch: str = "llama", vocab_size: int, hidden_size: int = 64,
               num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
               intermediate_size: int = 128, max_position_embeddings: int = 256, seed: int = 0,
               max_shard_size: str | None = None, dtype: str = "float32",
               eos_token_id: int | list[int] | None = 0, pad_token_id: int | None = 0,
               bos_token_id: int | None = None) -> Path:
    """Save a randomly initialised `arch` causal LM (safetensors, sharded when
    `max_shard_size` is small, plus generation_config.json) to `out_dir`; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    _check_model_args(arch=arch, hidden_size=hidden_size, num_layers=num_layers,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                      max_position_embeddings=max_position_embeddings, dtype=dtype,
                      max_shard_size=max_shard_size)
    config = _model_config(
        arch, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=bos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    out = Path(out_dir)
    model.save_pretrained(str(out), **_save_kwargs(model, max_shard_size))
    return out


# ---------------------------------------------------------------- data


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def make_instruction_jsonl(out_dir: str | Path, *, n: int = 2000, seed: int = 0) -> dict[str, Path]:
    """Write the first `n` stdlib docstring Q/A pairs as chat.jsonl, prompt_completion.jsonl
    and text.jsonl into `out_dir`, and as preference pairs (the docstring chosen, a damaged
    copy rejected: `preference_data.py`) preference.jsonl and preference_chat.jsonl;
    returns {"chat", "prompt_completion", "text", "preference", "preference_chat"} → path.

    `seed` is accepted for API symmetry; the pairs come in sorted file order, so the
    output depends only on the Python version's standard library."""
    del seed
    if not (isinstance(n, int) and n >= 1):
        raise ConfigError("samples", n, "an integer >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = _qa_pairs(n)
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in pairs]
    # The prompt ends with a newline so the completion starts on its own line: the
    # encoder joins prompt and completion tokens with nothing in between.
    prompt_completion = [{"prompt": q + "\n", "completion": a} for q, a in pairs]
    return {
        "chat": _write_jsonl(out / "chat.jsonl", chat),
        "prompt_completion": _write_jsonl(out / "prompt_completion.jsonl", prompt_completion),
        "text": _write_jsonl(out / "text.jsonl", [{"text": a} for _, a in pairs]),
        **write_preference_jsonl(out, pairs),
    }


def _check_all(out: str | Path, *, samples: int, vocab_size: int, names: Mapping[str, str] | None = None,
               **model_kw) -> None:
    """Every argument of `make_all`, before anything is written: ConfigError, named by
    `names` (see `_check_model_args`), for the first bad one."""
    def n(field: str) -> str:
        return (names or {}).get(field, field)

    _check_model_args(names=names, **model_kw)
    if not (isinstance(vocab_size, int) and vocab_size >= 300):
        raise ConfigError(n("vocab_size"), vocab_size, "an integer >= 300 (256 bytes + specials + merges)")
    if not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1):
        raise ConfigError(n("samples"), samples, "an integer >= 1")
    _check_fits(vocab_size, names=names, **model_kw)
    try:
        _qa_pairs(samples)  # enough docstrings? (cached for make_instruction_jsonl)
    except ConfigError as exc:
        raise ConfigError(n("samples"), exc.value, exc.allowed) from None
    _check_out(Path(out), n("out"))


def model_params(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, intermediate_size: int = 128, arch: str = "llama", **_: object) -> int:
    """The parameters `make_model` builds (untied embedding and head; qwen2's q/k/v biases).

    >>> model_params(512, hidden_size=64, num_layers=2)  # as transformers counts its LlamaForCausalLM
    139584
    """
    kv = hidden_size // num_heads * num_kv_heads
    attention = 2 * hidden_size * hidden_size + 2 * hidden_size * kv + (hidden_size + 2 * kv if arch == "qwen2" else 0)
    layer = attention + 3 * hidden_size * intermediate_size + 2 * hidden_size
    return 2 * vocab_size * hidden_size + num_layers * layer + hidden_size


def _available_bytes() -> int:
    """Memory this machine can give now (MemAvailable; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_fits(vocab_size: int, *, names: Mapping[str, str] | None = None, **model_kw) -> None:
    """ConfigError unless the model's build and save fit the memory available: built in
    fp32, cast to its dtype (a second copy), then written (about 8 bytes a parameter)."""
    params = model_params(vocab_size, **model_kw)
    need, have = 8 * params, _available_bytes()
    if need > have:
        flags = ", ".join((names or {}).get(f, f) for f in ("hidden_size", "num_layers", "intermediate_size"))
        raise ConfigError(flags, f"{params:,} parameters", f"a model whose build and save fit the memory available "
                          f"(about {need / 2**30:.1f} GiB for this one; {have / 2**30:.1f} GiB available)")


def make_all(out: str | Path, *, arch: str = "llama", samples: int = 2000, vocab_size: int = 512,
             **model_kw) -> dict[str, Path]:
    """Write a tokenizer and model into ``out/model/`` (one folder, the Hugging Face
    layout) and instruction data into ``out/data/``; returns every path written. A failure
    part-way removes the folders this call created."""
    _check_all(out, arch=arch, samples=samples, vocab_size=vocab_size, **model_kw)  # fail before writing
    out = Path(out)
    model_dir = out / "model"
    created = [p for p in (out, model_dir, out / "data") if not p.exists()]
    try:
        tok = make_tokenizer(model_dir, vocab_size=vocab_size)
        eos, im_end = tok.convert_tokens_to_ids([EOS_TOKEN, IM_END])
        # Generation stops at either end marker: <|im_end|> closes a chat turn.
        make_model(model_dir, arch=arch, vocab_size=len(tok), eos_token_id=[eos, im_end],
                   pad_token_id=tok.pad_token_id, **model_kw)
        data = make_instruction_jsonl(out / "data", n=samples)
    except BaseException:
        for folder in reversed(created):  # innermost first
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"model": model_dir, "tokenizer": model_dir, **data}


# ---------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m raytrain_platform.tools.tiny_llm",
                description="Write a tiny offline LLM, tokenizer and instruction data.")
    p.add_argument("out", help="output folder (model/ and data/ are written inside)")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x --hidden)")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--max-shard-size", default=None, help="e.g. 200KB: sharded safetensors")
    return p


# What the CLI's messages call each argument of `make_all`.
_FLAGS = {"arch": "--arch", "num_layers": "--layers", "hidden_size": "--hidden",
          "num_heads": "--heads", "num_kv_heads": "--kv-heads", "intermediate_size": "--intermediate",
          "samples": "--samples", "max_shard_size": "--max-shard-size"}


def _under(path: str | bytes, folder: Path) -> bool:
    """Whether `path` (an OSError's filename) lies in `folder`."""
    return Path(os.fsdecode(path)).absolute().is_relative_to(folder.absolute())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    kw = dict(arch=args.arch, samples=args.samples, vocab_size=512, num_layers=args.layers,
              hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
              intermediate_size=2 * args.hidden if args.intermediate is None else args.intermediate,
              max_shard_size=args.max_shard_size)
    try:
        _check_all(args.out, names=_FLAGS, **kw)  # the flags' names in the message
        paths = make_all(args.out, **kw)
    except UserError as exc:
        print(f"tiny_llm: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # passed the checks, failed while writing: bad input if it is out's
        where = exc.filename if exc.filename is not None else args.out
        print(f"tiny_llm: error: cannot write {where}: {exc.strerror or exc}", file=sys.stderr)
        ours = exc.errno in PATH_ERRNOS and (exc.filename is None or _under(exc.filename, Path(args.out)))
        return 2 if ours else 1
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
