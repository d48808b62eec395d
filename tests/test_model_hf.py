"""model=hf: a local HF directory (random tiny Qwen3 + a locally built fast tokenizer with a chat template)."""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration   # trains, compiles or starts processes: scripts/test.sh

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import importlib.util

    from transformers import Qwen3Config, Qwen3ForCausalLM

    # the character-level tokenizer with Qwen3's chat markers that scripts/make_random_qwen3.py builds (one definition)
    spec = importlib.util.spec_from_file_location("make_random_qwen3", ROOT / "scripts" / "make_random_qwen3.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    directory = tmp_path_factory.mktemp("hf_model")
    tokenizer, vocab_size = script.make_tokenizer()
    assert tokenizer.chat_template == TEMPLATE
    tokenizer.save_pretrained(directory)
    # Embedding rows past the tokenizer's vocabulary, as Qwen3's 151,936 rows for 151,669 tokens: the MASK id's row.
    config = Qwen3Config(vocab_size=vocab_size + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def test_hf_model_and_chat_template_data(hf_dir, tmp_path):
    from dflash_lab.data import Collator, build_dataset
    from dflash_lab.model import build_model, measure_acceptance
    from dflash_lab.presets import preset

    model, tok = build_model(**preset("model", "hf", target_path=str(hf_dir), device="cpu", block_size=4,
                                      draft_layers=2), activation_checkpointing=False)
    assert model.target_layer_ids == [1, 3]          # evenly spaced in [1, L-3] for 6 layers
    from dflash_lab.model.target import checkpoint_digest   # the files' digest: 16 GB are never hashed at start
    assert len(model.target_digest) == 16 and model.target_digest == checkpoint_digest(hf_dir)
    assert model.mask_token_id == tok.vocab_size and tok.eos_token_id in model.stop_token_ids  # added past the vocab
    file = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"ok {i}!"}]}
            for i in range(10)]
    file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = build_dataset("jsonl", tokenizer=tok, path=str(file), cache_dir=str(tmp_path))
    sample = ds[3]
    # Loss: the reply and its end marker; the newline the template writes after <|im_end|> is never generated.
    assert tok.decode(sample["input_ids"][sample["loss_mask"]].tolist(), show_special=True) == "ok 3!<|im_end|>"
    assert tok.decode(sample["input_ids"][~sample["loss_mask"]].tolist()).endswith("hi 3\nassistant\n\n")
    out = model(Collator(tok.pad_token_id, packed=True)([ds[i] for i in range(4)]), torch.Generator().manual_seed(0))
    assert torch.isfinite(out.loss) and out.count > 0
    result = measure_acceptance(model, [sample["input_ids"][:5]], max_new_tokens=8)
    assert result["tau"] >= 1.0
