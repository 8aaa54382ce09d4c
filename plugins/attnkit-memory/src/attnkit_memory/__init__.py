"""attnkit plugin: segment-recurrent memory attention (Transformer-XL, Compressive Transformer) and GTrXL gating."""
