"""The packaged sentence encoder: shape, normalisation, batch independence, caching."""

import numpy as np

from sao.compression.semantic import DEFAULT_MODEL_NAME, load_encoder


def test_default_encoder_is_packaged_minilm_with_384_dims(encoder):
    assert encoder.dim == 384
    assert encoder.name == DEFAULT_MODEL_NAME


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
