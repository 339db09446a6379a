"""Embedding models for `POST /v1/embeddings` (gateway/api/embeddings.py).

packaged    the MiniLM sentence encoder the embedding guard uses, published at start-up as the
            `embedding_model` `all-MiniLM-L6-v2`
encoders    `Embedders`: the encoders of embedding model versions, loaded once per process on first use
"""

from gateway.embeddings.encoders import Embedders
from gateway.embeddings.packaged import PACKAGED_NAME, register_packaged_encoder

__all__ = ["PACKAGED_NAME", "Embedders", "register_packaged_encoder"]
