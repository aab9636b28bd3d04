#!/usr/bin/env python3
"""Make a tiny random Llama model with a local word-level tokenizer, for engine tests and demos.

No hub access is needed: the weights are random (seeded, so every machine makes the same model)
and the tokenizer is a ``tokenizers`` WordLevel vocabulary saved as a ``PreTrainedTokenizerFast``.
Idempotent: when ``--out`` already holds a model made with the same parameters, nothing is done.

    python examples/make_tiny_model.py --out DIR [--layers N --hidden H --heads N --kv-heads N
        --vocab V --max-pos P --dtype bfloat16 --seed S --init-std X]

Without ``--out`` the model goes to ``${MEMCACHE_CACHE_DIR:-~/.cache/memcache}/models/<name>``
(``--name``, default derived from the parameters). The model directory is printed on the last
line of stdout. Needs ``torch``, ``transformers`` and ``tokenizers`` (the engine environments
have them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

PARAMS_FILE = "memcache_tiny_model.json"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def default_cache_dir() -> Path:
    root = os.environ.get("MEMCACHE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "memcache")
    return Path(root) / "models"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="model directory (default: cache dir / --name)")
    p.add_argument("--name", default=None, help="model name under the cache dir when --out is absent")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2.75 x hidden)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-pos", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init-std",
        type=float,
        default=0.1,
        help="std of the random weights; larger than the usual 0.02 so outputs depend on the context",
    )
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.intermediate is None:
        args.intermediate = int(args.hidden * 2.75) // 64 * 64 or 64
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args.vocab <= len(SPECIAL_TOKENS):
        p.error(f"--vocab must be larger than {len(SPECIAL_TOKENS)}")
    return args


def model_params(args: argparse.Namespace) -> dict:
    return {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "intermediate": args.intermediate,
        "vocab": args.vocab,
        "max_pos": args.max_pos,
        "dtype": args.dtype,
        "seed": args.seed,
        "init_std": args.init_std,
    }


def default_name(params: dict) -> str:
    return (
        f"tiny-llama-l{params['layers']}-h{params['hidden']}-a{params['heads']}-kv{params['kv_heads']}"
        f"-v{params['vocab']}-{params['dtype']}-s{params['seed']}"
    )


def is_complete(out: Path, params: dict) -> bool:
    try:
        saved = json.loads((out / PARAMS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return saved == params and (out / "config.json").exists() and (out / "tokenizer.json").exists()


def save_tokenizer(out: Path, vocab_size: int, max_pos: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_pos,
    )
    fast.save_pretrained(out)


def save_model(out: Path, params: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(params["seed"])
    config = LlamaConfig(
        vocab_size=params["vocab"],
        hidden_size=params["hidden"],
        intermediate_size=params["intermediate"],
        num_hidden_layers=params["layers"],
        num_attention_heads=params["heads"],
        num_key_value_heads=params["kv_heads"],
        max_position_embeddings=params["max_pos"],
        initializer_range=params["init_std"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    dtype = getattr(torch, params["dtype"])
    model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)


def make(args: argparse.Namespace) -> Path:
    params = model_params(args)
    out = args.out or default_cache_dir() / (args.name or default_name(params))
    out = out.expanduser().resolve()
    if is_complete(out, params):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_model(tmp, params)
        save_tokenizer(tmp, params["vocab"], params["max_pos"])
        (tmp / PARAMS_FILE).write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")
        # Another process may have made the same model meanwhile (test workers running side by
        # side): keep its copy, which may be in use, rather than replace it.
        if is_complete(out, params):
            return out
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)  # atomic: a half-made model is never seen under `out`
        except OSError:
            if not is_complete(out, params):  # not a same-model maker that renamed first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    out = make(parse_args(argv))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
