"""Data: tokenizers, raw sources, preparation into token shards, the memory-mapped corpus, mixtures, the loader.

    tokenizers.py   build_tokenizer: a tokenizer.json / HF folder, or "byte"
    sources.py      raw documents (json/jsonl(.gz)/parquet/txt, hub streaming), read in chunks
    prepare.py      chunks -> token shards + manifest, in parallel, resumable (scripts/prepare_data.py)
    corpus.py       TokenCorpus (memory-mapped shards) and open_corpus, what train.py calls
    mixture.py      [data] mixture: several prepared corpora, each sample's source a function of its index
    loader.py       GlobalBatchLoader: a step's batch depends on the global batch only

Import the modules themselves: this package imports nothing, so that a preparation worker
process loads numpy and the tokenizer, not torch.
"""
