"""The packaged sentence encoder: shape, normalisation, batch independence, caching."""

import json

import numpy as np

from sao.compression.semantic import DEFAULT_MODEL, DEFAULT_MODEL_NAME, encoder_dim, load_encoder


def test_default_encoder_is_packaged_minilm_with_384_dims(encoder):
    assert encoder.dim == 384
    assert encoder.name == DEFAULT_MODEL_NAME
    assert encoder_dim(DEFAULT_MODEL) == encoder.dim  # read from metadata, as the trainer does


def test_encoder_dim_reads_the_last_width_in_the_module_list_without_loading(tmp_path):
    # A folder with metadata only (no weights): loading it would fail, reading it must not.
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 768}))
    for folder, config in (("1_Pooling", {"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True,
                                          "pooling_mode_max_tokens": True}),
                           ("2_Dense", {"in_features": 1536, "out_features": 256})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
    assert encoder_dim(str(tmp_path)) == 256
    (tmp_path / "2_Dense" / "config.json").unlink()  # without the Dense layer: pooling's two modes
    modules.pop()
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert encoder_dim(str(tmp_path)) == 1536


def test_embeddings_are_float32_unit_vectors(encoder, dialogue):
    texts, _ = dialogue
    vectors = encoder.encode(texts)
    assert vectors.shape == (len(texts), 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_empty_list_gives_zero_rows(encoder):
    vectors = encoder.encode([])
    assert vectors.shape == (0, 384)
    assert vectors.dtype == np.float32


def test_embedding_does_not_depend_on_batch_companions(encoder, dialogue):
    # The online path encodes one text per call and the batch path all at once; the INT8
    # memory of both must match bit for bit.
    texts, _ = dialogue
    together = encoder.encode(texts)
    alone = np.stack([encoder.encode([text])[0] for text in texts])
    np.testing.assert_array_equal(together, alone)


def test_similar_texts_are_closer_than_unrelated(encoder):
    a, b, c = encoder.encode(["Incorrect. Try again.\n13", "Incorrect. Try again.\n14",
                              "The weather in Paris is sunny today."])
    assert float(a @ b) > float(a @ c) + 0.2


def test_load_encoder_returns_the_cached_instance(encoder):
    assert load_encoder("default", "cpu") is encoder


def _tiny_bert_folder(path):
    """A plain Hugging Face BERT folder (random weights, 48-d), the shape of a BERT-base checkpoint."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["the", "you", "go", "north", "south", "take", "ruby", "incorrect", "try", "again", "."]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *"abcdefghijklmnopqrstuvwxyz0123456789"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    config = BertConfig(vocab_size=len(vocab), hidden_size=48, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(path)
    return path


def test_a_bert_model_folder_works_and_its_dimension_is_read(tmp_path):
    from sao.compression.semantic import SemanticEncoder

    bert = SemanticEncoder(str(_tiny_bert_folder(tmp_path)))
    assert bert.dim == 48 and bert.name == str(tmp_path)
    texts = ["You go north.\ntake ruby", "Incorrect. Try again.\n12", "go south"]
    vectors = bert.encode(texts)
    assert vectors.shape == (3, 48)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(vectors, np.stack([bert.encode([t])[0] for t in texts]))


def test_repeated_texts_come_from_the_cache_and_throughput_is_exported(encoder):
    from prometheus_client import REGISTRY

    def embedded():
        return REGISTRY.get_sample_value("sao_encoder_sentences_total", {"encoder": encoder.name}) or 0.0

    texts = [f"You go north.\nA corridor numbered {i} in the cache test." for i in range(3)]
    before = embedded()
    first = encoder.encode(texts + texts[:1])  # a repeat inside one call is embedded once
    assert embedded() == before + 3
    again = encoder.encode(texts[::-1])
    assert embedded() == before + 3  # all cached
    np.testing.assert_array_equal(again, first[[2, 1, 0]])
    np.testing.assert_array_equal(first[3], first[0])
    assert REGISTRY.get_sample_value("sao_encoder_sentences_per_second", {"encoder": encoder.name}) > 0
    encoder.clear_cache()
    np.testing.assert_array_equal(encoder.encode(texts), first[:3])  # recomputed bit for bit
    assert embedded() == before + 6


def test_cache_keeps_only_the_latest_texts(tmp_path):
    from sao.compression.semantic import SemanticEncoder

    bert = SemanticEncoder(str(_tiny_bert_folder(tmp_path)), cache_size=2)
    bert.encode(["go north", "go south", "take ruby"])
    assert list(bert._cache) == ["go south", "take ruby"]
    assert SemanticEncoder(str(tmp_path), cache_size=0).encode(["go north"]).shape == (1, 48)
