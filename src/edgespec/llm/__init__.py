"""llama.cpp and GGUF files: the only package that imports llama_cpp or reads/writes GGUF.

``llamacpp`` wraps llama-cpp-python (docs/design.md 3), ``models`` is the model registry
(docs/design.md 4); the GGUF reader, writer, per-architecture handling and shard naming live
beside them.
"""
