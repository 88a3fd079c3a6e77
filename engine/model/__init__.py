"""engine.model: config parsing, the one DecoderLayer, the model, the loader and generated checkpoints."""
