"""Code corpus: top-level functions/classes read with ast, signature = prompt, body = loss, capped length."""

import torch

from dflash_lab.data import ByteTokenizer, build_dataset

SOURCE = '''
import os

def add(a, b):
    """Add."""
    return a + b


class Box:
    size = 3

    def grow(self):
        self.size += 1


def long_one(x):
''' + "".join(f"    x = x + {i}\n" for i in range(200)) + "    return x\n"


def test_functions_and_classes_with_prompt_header(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mod.py").write_text(SOURCE)
    (tmp_path / "lib" / "test").mkdir()
    (tmp_path / "lib" / "test" / "skipped.py").write_text(SOURCE)
    ds = build_dataset("code", stdlib_dir=str(tmp_path / "lib"), cache_dir=tmp_path / "cache", num_samples=None,
                       max_length=300, min_length=8)
    tok = ByteTokenizer()
    assert len(ds) == 3
    first = ds[0]
    prompt = tok.decode(first["input_ids"][~first["loss_mask"]])
    body = tok.decode(first["input_ids"][first["loss_mask"]])
    assert prompt == "# module: mod\ndef add(a, b):\n" and body.startswith('    """Add."""')
    assert "class Box" in tok.decode(ds[1]["input_ids"])
    assert ds.lengths[2] == 300 and ds[2]["input_ids"][-1] == tok.eos_token_id
    assert ds.stats["kept"] == 3 and ds.stats["truncated"] == 1   # long_one was cut: summary data_truncated
    assert torch.equal(torch.as_tensor(ds.lengths), torch.tensor([len(ds[i]["input_ids"]) for i in range(3)]))


def test_real_stdlib_is_read_at_run_time(tmp_path):
    ds = build_dataset("code", cache_dir=tmp_path, num_samples=25, max_length=512)
    assert len(ds) == 25 and ds.lengths.max() <= 512
    text = ByteTokenizer().decode(ds[0]["input_ids"])
    assert text.startswith("# module: ") and ("def " in text or "class " in text)
