"""Vision-language policies (Qwen2-VL family): image placeholders, multimodal RoPE positions, and the
tiny model trellis builds offline to test them."""
