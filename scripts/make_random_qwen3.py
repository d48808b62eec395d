"""A random-weight Qwen3 in a local Hugging Face directory, with a locally built tokenizer (no download).

    python scripts/make_random_qwen3.py /tmp/qwen3_random                      # hidden 1024, 8 layers (~0.1B)
    python scripts/make_random_qwen3.py /tmp/qwen3_tiny --hidden 64 --layers 8 --heads 4 --kv-heads 2 \
        --head-dim 16 --intermediate 192
    python scripts/make_random_qwen3.py /tmp/qwen3_8b --shape qwen3_8b --random-init   # Qwen3-8B, no weights

For ``python -m dflash_lab.train model=hf model.target_path=<dir>`` where the real Qwen3 tokenizer is not
available offline: the tokenizer is a character-level WordLevel tokenizer with Qwen3's chat markers
(``<|im_start|>``, ``<|im_end|>``) and a ChatML template, built as tests/test_model_hf.py builds one; it covers
printable ASCII and newline (every character of data=synthetic). The embedding has 4 rows past the tokenizer's
vocabulary, as Qwen3's 151,936 rows for 151,669 tokens (the draft's MASK id takes the first); ``--shape qwen3_8b``
keeps Qwen3-8B's own 151,936 rows (conf/model/qwen3_8b.yaml's ``target_config``, the one definition of that shape),
so the LM head is the real one's size.

``--random-init``: no weights are written, only config.json, the tokenizer and ``random_weights.json``
(``{"seed": s}``); training builds the target from the config with random weights on its device
(dflash_lab/model/random_target.py): the Qwen3-8B shape without writing and reading 16 GB. Without it the weights
are initialised here and saved (seconds at the default shape). Builds in seconds either way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SHAPES = ("custom", "qwen3_8b")


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer, len(vocab)


def qwen3_8b_fields() -> dict:
    """Qwen3-8B's shape: conf/model/qwen3_8b.yaml's ``target_config`` (its token ids are the tokenizer's here)."""
    from dflash_lab.presets import preset

    fields = dict(preset("model", "qwen3_8b")["target_config"])
    for key in ("model_type", "architectures", "bos_token_id", "eos_token_id"):
        fields.pop(key, None)
    return fields


def make_random_qwen3(out_dir: str | Path, *, hidden: int = 1024, layers: int = 8, heads: int = 16,
                      kv_heads: int = 8, head_dim: int = 64, intermediate: int = 3072, max_positions: int = 4096,
                      seed: int = 0, shape: str = "custom", random_init: bool = False) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = make_tokenizer()
    tokenizer.save_pretrained(out)
    if shape == "qwen3_8b":
        fields = qwen3_8b_fields()
    else:
        fields = {"vocab_size": vocab + 4, "hidden_size": hidden, "intermediate_size": intermediate,
                  "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                  "head_dim": head_dim, "max_position_embeddings": max_positions, "tie_word_embeddings": False}
    config = Qwen3Config(**fields, pad_token_id=0, eos_token_id=2)
    if random_init:
        config.save_pretrained(out)
        (out / "random_weights.json").write_text(json.dumps({"seed": int(seed)}) + "\n")
        return out
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--shape", default="custom", choices=SHAPES, help="qwen3_8b: conf/model/qwen3_8b.yaml's "
                        "target shape (the size arguments below are then not read); custom: those arguments")
    parser.add_argument("--random-init", action="store_true", help="write no weights: config, tokenizer and "
                        "random_weights.json (training builds random weights on its device)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_random_qwen3(args.out_dir, hidden=args.hidden, layers=args.layers, heads=args.heads,
                            kv_heads=args.kv_heads, head_dim=args.head_dim, intermediate=args.intermediate,
                            seed=args.seed, shape=args.shape, random_init=args.random_init)
    config = json.loads((out / "config.json").read_text())
    print(json.dumps({"target_path": str(out), "shape": args.shape, "hidden": config["hidden_size"],
                      "layers": config["num_hidden_layers"], "vocab": config["vocab_size"],
                      "random_init": args.random_init}))


if __name__ == "__main__":
    main()
