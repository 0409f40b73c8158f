"""Vision encoders and projectors: an image's tiles -> rows of the text model's embeddings."""
