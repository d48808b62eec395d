"""Datasets, tokenizer and collators: everything between raw text and the collated batch (docs/CONTRACTS.md).

API (stable; the training loop is written against it):

    from dflash_lab.data import build_dataset, ByteTokenizer, collate_padded, collate_packed, Collator

    tokenizer = ByteTokenizer()                       # or the tokenizer returned by dflash_lab.model.build_model
    ds = build_dataset("synthetic", tokenizer=tokenizer, num_samples=3000, seed=0, cache_dir=None)
    # kinds: "synthetic" | "code" | "jsonl"; the other keys are the plain keys of conf/data/<kind>.yaml
    ds.lengths                  # np.int64[N], read from the cached lengths array (no sample iteration)
    ds[i]                       # {"input_ids": Long[L], "loss_mask": Bool[L], "index": i}
    train_ds, heldout_ds = ds.split()                 # held-out share = probe_fraction (length-stratified)
    train_ds.lengths, train_ds.source_indices         # a split is a dataset view with its own 0..n-1 indices
    ds.stats                    # build counts; ds.stats["skipped"]: skipped lines per reason (jsonl: SKIP_REASONS)

    # collate: one function per layout, both return the CONTRACTS.md batch dict
    batch = collate_padded(samples, sample_index, lengths, pad_id)   # lengths: effective length per sample
    batch = collate_packed(samples, sample_index, lengths, pad_id)   # ONE row, per-document position_ids/doc_ids
    collate_fn = Collator(pad_id=tokenizer.pad_token_id, packed=policy.packed, effective_lengths=policy.lengths)
    loader = DataLoader(train_ds, batch_sampler=policy, collate_fn=collate_fn)

Tokenizers expose: encode(text) -> list[int], decode(ids) -> str, encode_chat(messages) -> (ids, loss_mask)
(both take tools=, a line's function schemas; HFTokenizerAdapter.encode_chat also takes chat_template=, the
data.chat_template override),
pad_token_id, mask_token_id, bos_token_id, eos_token_id, vocab_size, fingerprint.
"""

from dflash_lab.data.collate import Collator, collate_packed, collate_padded
from dflash_lab.data.datasets import TokenizedDataset, build_dataset, default_cache_dir
from dflash_lab.data.tokenizer import ByteTokenizer, HFTokenizerAdapter

__all__ = [
    "ByteTokenizer",
    "Collator",
    "HFTokenizerAdapter",
    "TokenizedDataset",
    "build_dataset",
    "collate_packed",
    "collate_padded",
    "default_cache_dir",
]
