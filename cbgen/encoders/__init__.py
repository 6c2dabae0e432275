"""Encoding models: each row read once by a model that returns vectors, not text. The embed kind pools a text's
token vectors into one embedding (an encoder as sentence-transformers configures it, or a decoder embedding model);
the reward kind reads a conversation with a sequence-classification model (a reward model's score, a classifier's
label probabilities).

    load.py      the model, its tokenizer and what its sentence-transformers modules say (pooling, normalising)
    requests.py  rows into token ids: a text, a prompt, or a conversation in the model's chat template
    encoder.py   rows of similar length batched by a token budget, one forward pass per batch, pooled
    rows.py      what the writer stores for an encoded row
"""
